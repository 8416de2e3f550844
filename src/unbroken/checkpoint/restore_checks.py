"""What a restore reads and checks before any tensor loads.

The step's plain values and this rank's RNG record, decoded (bytes that pass their
checksum and still do not decode are the checkpoint's fault: ``CheckpointCorruptError``,
naming the file), and whether the checkpoint fits the state at all: the state's
flattened entries against the DCP metadata, the manifest and the RNG record, a
``CheckpointMismatchError`` naming every key, shape or generator that differs (another
model, a scheduler added since the save). So nothing of a checkpoint that does not fit,
or cannot be read whole, reaches the state.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from unbroken.checkpoint import json_values
from unbroken.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, Manifest, step_dir
from unbroken.checkpoint.format.reader import TierReader
from unbroken.checkpoint.save_job import rng_file
from unbroken.checkpoint.staging.tree import alias_key, local_tensor
from unbroken.checkpoint.state_dicts import KIND_OPTIMIZER, KIND_STATEFUL, FlatState
from unbroken.state.rng import RngState, decode_rng_state
from unbroken.storage import Store

_SHOW = 12  # names listed in an error before "and N more"


def check_compatible(
    flat: FlatState, metadata: Metadata, manifest: Manifest, *, strict: bool, where: str
) -> None:
    """Raise CheckpointMismatchError naming every key or shape that differs."""
    saved = metadata.state_dict_metadata
    mine = flat.tensors
    saved_values = set(manifest.extra.get("values", {}))
    missing = sorted(set(mine) - set(saved)) + sorted(set(flat.values) - saved_values)
    entries = set(flat.kinds)
    not_in_state = sorted(k for k in saved if k.split(".", 1)[0] in entries and k not in mine)
    unexpected: list[str] = []
    if strict:
        unexpected = not_in_state + sorted(
            k for k in saved_values - set(flat.values) if k in entries
        )
    regrown = sorted(
        {k.split(".", 1)[0] for k in (*missing, *not_in_state)}
        & {n for n, kind in flat.kinds.items() if kind == KIND_STATEFUL}
    )
    shapes, cast = [], []
    shared = [k for k in sorted(set(mine) & set(saved)) if _elements_share_memory(mine[k])]
    for key in sorted(set(mine) & set(saved)):
        md, value = saved[key], mine[key]
        if isinstance(value, torch.Tensor) != isinstance(md, TensorStorageMetadata):
            kind = "a tensor" if isinstance(md, TensorStorageMetadata) else "a plain value"
            shapes.append(f"{key}: {kind} in the checkpoint, not in the state")
        elif isinstance(value, torch.Tensor) and tuple(md.size) != tuple(value.shape):
            shapes.append(
                f"{key}: shape {tuple(md.size)} in the checkpoint, "
                f"{tuple(value.shape)} in the state"
            )
        elif isinstance(value, torch.Tensor) and md.properties.dtype != value.dtype:
            cast.append(f"{key} ({_dtype(md.properties.dtype)} -> {_dtype(value.dtype)})")
    if cast:  # a precision changed on purpose loads so too; by mistake, it rounds unseen
        warnings.warn(
            f"checkpoint {where}: tensors saved in another dtype are cast to the state's: "
            f"{_listed(cast)}. Give them the saved dtype before restoring "
            "(model.to(dtype)) unless the change of precision is meant",
            RuntimeWarning,
            stacklevel=6,  # the caller of restore() or load()
        )
    if untied := _tied_here_not_there(mine, metadata):  # warned, not refused: see below
        warnings.warn(
            f"checkpoint {where}: the state ties "
            f"{'; '.join(' to '.join(keys) for keys in untied[:_SHOW])} (one tensor), which "
            "the checkpoint holds as different tensors, so one overwrites the other in the "
            "restore. Saved untied? Restore into the model untied, as it was saved, and tie "
            "the weights after. (Saved tied by ranks that held different values of it, each "
            "rank's saved in turn, it is restored as one of them.)",
            RuntimeWarning,
            stacklevel=6,  # the caller of restore() or load()
        )
    if shared:
        raise CheckpointMismatchError(
            f"cannot restore checkpoint {where} into the state: its entries "
            f"{', '.join(shared[:_SHOW])} are views whose elements share memory (made by "
            "expand()), which nothing can be loaded into; give them tensors of their own "
            "(.clone()). Nothing was changed"
        )
    optimizers = {n for n, k in flat.kinds.items() if k == KIND_OPTIMIZER}
    for name in sorted(optimizers):  # a group added or dropped: no scheduler's doing
        had, has = _groups(name, [*saved, *saved_values]), _groups(name, [*mine, *flat.values])
        if had and had != has:  # (none: the checkpoint has no such optimizer)
            raise CheckpointMismatchError(
                f"checkpoint {where}: the optimizer {name!r} has {has} parameter group(s), "
                f"the checkpoint's {had} (a no-weight-decay group added or dropped?); build "
                "the optimizer with the parameter groups of the run that saved it"
            )
    reported = (missing if strict else []) + unexpected
    hyper = [k for k in reported if _is_group_setting(k, optimizers)]
    if hyper and len(hyper) == len(reported) and not shapes:
        raise CheckpointMismatchError(
            f"checkpoint {where}: the optimizer's parameter-group settings differ from the "
            f"state's ({', '.join(hyper[:_SHOW])}): an LR scheduler added or removed since "
            "the save (schedulers write settings such as initial_lr, max_lr into the "
            "optimizer)? Build optimizer and scheduler as the saving run did, or restore "
            "with strict=False to keep this run's settings where the checkpoint has none"
        )
    parts = []
    for label, names in (
        ("missing from the checkpoint", missing),
        ("in the checkpoint but not in the state", unexpected),
        ("mismatched", shapes),
    ):
        if names:
            parts.append(f"{label}: {_listed(names)}")
    if missing and not strict:
        parts = [p for p in parts if not p.startswith("missing")]
    grew = (
        f"the state_dict() of {', '.join(map(repr, regrown))} is laid out otherwise than "
        "when saved (a list or dict in it grew or shrank in training?), and a restore "
        "loads into the layout the object has now. Give it the saved layout before "
        "restoring (as many list items, the same keys), or keep what grows in one tensor"
    )
    have = {k.split(".", 1)[0] for k in (*mine, *flat.values)}
    if emptied := [n for n in regrown if n not in have]:
        grew = (
            f"the state_dict() of {', '.join(map(repr, emptied))} is empty now and was not "
            "when saved (switched off since, a GradScaler made with enabled=False?)"
        )
    # (settings a scheduler wrote into the optimizer's groups: this run's stay, as documented)
    left = [k for k in not_in_state if not _is_group_setting(k, optimizers)]
    if not strict and left and not parts:
        warnings.warn(
            f"checkpoint {where}: restored with strict=False without "
            f"{_listed(left)}, which the state has no place for" + (f": {grew}" if regrown else ""),
            RuntimeWarning,
            stacklevel=6,  # the caller of restore() or load()
        )
    if parts and regrown and not shapes and emptied:
        raise CheckpointMismatchError(
            f"checkpoint {where}: {grew}: restore with strict=False to leave it as it is, "
            "or take it out of the state: " + "; ".join(parts)
        )
    if parts and regrown and not shapes:
        raise CheckpointMismatchError(f"checkpoint {where}: {grew}: " + "; ".join(parts))
    if parts:
        hint = ""
        if missing and strict and not unexpected and not shapes:  # only added to the state
            hint = (". Entries added since the save (an EMA, a scheduler): restore with "
                    "strict=False to load what the checkpoint has, keep those as is")  # fmt: skip
        raise CheckpointMismatchError(
            f"checkpoint {where} does not match the state being restored "
            f"(another model?): " + "; ".join(parts) + hint
        )


def _tied_here_not_there(mine: dict[str, Any], metadata: Metadata) -> list[tuple[str, ...]]:
    """Keys the state ties (one memory: ``lm_head.weight is embed.weight``) whose saved
    tensors differ, told by their chunks' checksums: the last loaded would win."""
    by_memory: dict[tuple, list[str]] = {}
    for key, value in mine.items():
        if isinstance(value, torch.Tensor) and key in metadata.state_dict_metadata:
            by_memory.setdefault(alias_key(local_tensor(value)), []).append(key)
    tied = {k: keys for keys in by_memory.values() if len(keys) > 1 for k in keys}
    if not tied:
        return []
    chunks: dict[str, list[tuple]] = {}
    for index, location in (metadata.storage_data or {}).items():
        if index.fqn in tied:
            crc = getattr(location, "crc32c", None)  # torch's own format: no checksum
            chunks.setdefault(index.fqn, []).append((tuple(index.offset or ()), crc))
    return sorted(
        keys
        for keys in {tuple(v) for v in tied.values()}
        if len({frozenset(chunks.get(k, ())) for k in keys}) > 1
        and all(crc is not None for k in keys for _, crc in chunks.get(k, ()))
    )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def other_optimizers(flat: FlatState, metadata: Metadata, manifest: Manifest) -> dict[str, str]:
    """The state's optimizers that are not of the kind that saved the checkpoint (SGD
    saved, AdamW now), each with what tells it: the checkpoint's groups lack settings of
    this kind's own (its numeric ``defaults``: AdamW's betas and eps). A scheduler only
    adds settings (OneCycleLR's max_lr, SWALR's swa_lr), and switches (``foreach``,
    ``fused``) come and go with torch versions: neither tells a kind."""
    saved = [*metadata.state_dict_metadata, *manifest.extra.get("values", {})]
    other = {}
    for name in sorted(n for n, k in flat.kinds.items() if k == KIND_OPTIMIZER):
        had = _settings(name, saved)
        lacking = flat.settings.get(name, set()) - had
        if had and lacking:  # (none: the checkpoint has no such optimizer)
            theirs = had - _settings(name, [*flat.tensors, *flat.values])
            other[name] = (
                f"its parameter groups hold {', '.join(sorted(lacking)[:_SHOW])}, the "
                f"checkpoint's do not (they hold {', '.join(sorted(theirs)[:_SHOW]) or 'none'}"
                " instead)"
            )
    return other


def refuse_other_optimizers(other: dict[str, str], *, strict: bool, where: str) -> None:
    """Raise CheckpointMismatchError (strict), or warn that they are left as they are."""
    if not other:
        return
    said = "; ".join(f"{name!r}: {why}" for name, why in other.items())
    if strict:
        raise CheckpointMismatchError(
            f"checkpoint {where}: the optimizer is not of the kind that saved it ({said}): "
            "an optimizer's state loads only into one of its kind. Build the optimizer "
            "the saving run used, or, to change optimizers, restore with strict=False (it "
            "leaves this one as it is) or without it in the state. Nothing was changed"
        )
    warnings.warn(
        f"checkpoint {where}: left as it is, not of the kind that saved the checkpoint: {said}",
        RuntimeWarning,
        stacklevel=6,
    )


def _settings(optimizer: str, keys: list[str]) -> set[str]:
    """The names of ``optimizer``'s group settings (``lr`` of ``optim.param_groups.0.lr``)."""
    prefix = f"{optimizer}.param_groups."
    return {k.rsplit(".", 1)[1] for k in keys if k.startswith(prefix) and k.count(".") == 3}


def _elements_share_memory(value: Any) -> bool:
    """A tensor with a stride of 0 over more than one element (``t.expand(...)``): a
    copy into it fails half-way through a restore, after other tensors were loaded."""
    if not isinstance(value, torch.Tensor):
        return False
    return any(st == 0 and n > 1 for st, n in zip(value.stride(), value.shape))


def _groups(optimizer: str, keys: list[str]) -> int:
    """How many parameter groups ``optimizer``'s keys (``optim.param_groups.N.lr``) hold."""
    prefix = f"{optimizer}.param_groups."
    found = {k[len(prefix) :].split(".", 1)[0] for k in keys if k.startswith(prefix)}
    return len(found)


def _is_group_setting(key: str, optimizers: set[str]) -> bool:
    """``optim.param_groups.0.initial_lr``: a setting of an optimizer's parameter group."""
    parts = key.split(".")
    return len(parts) == 4 and parts[0] in optimizers and parts[1] == "param_groups"


def check_generators(flat: FlatState, rng: RngState | None, strict: bool, where: str) -> None:
    """Each generator of the state finds a state of its own size in this rank's record
    (a rank the checkpoint had no record for keeps its own, as its RNG streams do)."""
    if rng is None:
        return
    for name, generator in flat.generators.items():
        if name in flat.nested:
            continue  # loaded through DCP (an older checkpoint)
        saved = rng.generators.get(name)
        if saved is None:
            if strict:
                raise CheckpointMismatchError(
                    f"state entry {name!r} is a torch.Generator, but {where} holds no state "
                    f"for it (saved entries: {sorted(rng.generators) or 'none'}); pass "
                    "strict=False to keep its current state"
                )
            continue
        size = generator.get_state().numel()
        if saved.numel() != size:
            raise CheckpointMismatchError(
                f"state entry {name!r}: {where} holds a {saved.numel()}-byte generator state, "
                f"but this {generator.device} generator's state has {size} bytes"
            )


def _listed(names: list[str], *, quoted: bool = False) -> str:
    """The first _SHOW names, and how many more."""
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(map(repr, names[:_SHOW]) if quoted else names[:_SHOW]) + more


def saved_values(manifest: Manifest, durable: Store, rank: int) -> dict[str, Any]:
    """This rank's plain values, decoded: rank 0's, with those this rank saved as its own
    where they differed. Not a mapping: the manifest is at fault (read as names, a string
    would make its letters the keys, "another model?")."""
    url = durable.url_for(f"{step_dir(manifest.step)}/{MANIFEST_NAME}")
    values = manifest.extra.get("values", {})
    per_rank = manifest.extra.get("rank_values", {})
    for what, doc in (("values", values), ("rank_values", per_rank)):
        if not isinstance(doc, dict):
            raise CheckpointCorruptError(
                f"{url}: extra.{what} is a {type(doc).__name__}, not a mapping of entry "
                "names to plain values",
                step=manifest.step,
                file=MANIFEST_NAME,
                url=url,
            )
    own = per_rank.get(str(rank), {})
    if not isinstance(own, dict):
        raise CheckpointCorruptError(
            f"{url}: extra.rank_values.{rank} is a {type(own).__name__}, not a mapping",
            step=manifest.step,
            file=MANIFEST_NAME,
            url=url,
        )
    differed = sorted({k for v in per_rank.values() if isinstance(v, dict) for k in v})
    if rank >= manifest.world_size and (differed or manifest.world_size == 1):
        names = _listed(differed or sorted(values), quoted=True)
        why = (
            f"on {manifest.world_size} ranks, whose values of {names} differed"
            if differed  # saved on one rank, nothing tells a per-rank value from a shared one
            else f"on one rank, so nothing tells whether its values of {names} are per rank "
            "(a count of this rank's samples) or the job's"
        )
        if differed or values:
            warnings.warn(
                f"rank {rank}: checkpoint step {manifest.step} was saved {why}; this rank "
                "gets rank 0's",
                RuntimeWarning,
                stacklevel=5,
            )
    return json_values.decode({**values, **own})


def read_rng(reader: TierReader, manifest: Manifest, rank: int, durable: Store) -> RngState | None:
    """This rank's RNG state, decoded. Bytes that pass their checksum but do not decode
    are the durable copy's fault too (every copy holds those bytes), so the error names
    it and the step is given up at once."""
    fname = rng_file(rank)
    if fname not in manifest.files:
        return None
    data = reader.read_whole(fname)
    try:
        return decode_rng_state(json.loads(data))
    except ValueError as e:  # RngStateError, or not JSON / not UTF-8
        url = durable.url_for(f"{step_dir(manifest.step)}/{fname}")
        raise CheckpointCorruptError(f"{url}: {e}", step=manifest.step, file=fname, url=url) from e
