"""Restore: the newest committed checkpoint that loads whole, from the nearest intact tier.

Candidates are the committed steps of the durable tier, newest first (the coordinator
lists them and tells every rank). For each, the node's own tiers are tried first: a rank
reads every file its memory tier (shared memory) or else its disk staging tier holds at
its listed size, beside a manifest equal to the durable one, from there, and the rest
from the durable tier (on several nodes, each node holds its own ranks' files). When no
rank has a local file, or a local copy turns out corrupt, the durable tier is read; when
the corruption lies in a durable file the staging attempt read, the step is given up at
once (its durable attempt would read the same bytes). Every decision is agreed over the
manager's group, so all ranks walk the same (step, tier) sequence: a corrupt copy sends
every rank on to the next candidate together, with a warning; a mismatch with the state
(another model, named by key), a checkpoint a newer unbroken wrote (an older step's run
would save over it) and a Ctrl-C inside the read end the restore at once. What is not
tensor bytes (the manifest, its plain values, this rank's RNG file) is read and checked
before any tensor is loaded: a fault there falls back like any corruption (naming the
file) before anything of that step reaches the state."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from unbroken._util.collectives import Group
from unbroken.checkpoint.catalog import missing_or_short
from unbroken.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    NewerFormatError,
    NoCheckpointError,
    raise_if_interrupted,
)
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    step_dir,
)
from unbroken.checkpoint.format.planners import SafeLoadPlanner
from unbroken.checkpoint.format.reader import TierReader
from unbroken.checkpoint.peers.peer_store import PeerStore
from unbroken.checkpoint.restore_agreement import agree_on_step, agreed_listing
from unbroken.checkpoint.restore_checks import (
    check_compatible,
    check_generators,
    other_optimizers,
    read_rng,
    refuse_other_optimizers,
    saved_values,
)
from unbroken.checkpoint.save_job import describe, rng_file
from unbroken.checkpoint.state_dicts import (
    FlatState,
    collect,
    fit_to_saved,
    load_generator_through_dcp,
    restore_into,
)
from unbroken.state.rng import RngState, apply_rng_state
from unbroken.storage import Store

log = logging.getLogger(__name__)

_SHOW = 12  # files listed in an error before the rest are left out


@dataclass(frozen=True)
class Restored:
    """What restore loaded: which committed step, from which tier, how long it took."""

    step: int
    tier: str
    """Where this rank's files came from, nearest first: "memory" (the node's copy in
    shared memory), "staging" (its copy on local disk), "durable", joined by "+" where
    they were several (say "memory+durable": what the node held, the rest downloaded)."""
    url: str
    seconds: float
    manifest: Manifest
    newer: tuple[int, ...] = ()
    """Steps above this one with a manifest in the listing every rank agreed on: those an
    automatic restore would have tried first (none unless a ``step`` was asked for, or
    newer ones failed their checks)."""


@dataclass
class _Attempt:
    """What one rank found when preparing to load (step, tier)."""

    verdict: str  # ok | corrupt | mismatch | newer | error
    message: str = ""
    local_files: int = 0
    """Files this rank found whole in its node's tiers (the local attempt)."""
    durable_corrupt: bool = False
    """The corruption is in the durable tier's bytes: reading that tier would meet it again."""


@dataclass(frozen=True)
class _Failed:
    """(step, tier) did not load."""

    durable_corrupt: bool
    """Its durable copy is corrupt, so the step is not tried again from the durable tier."""


def _sources(reader: TierReader, tiers: Sequence[tuple[str, Store]]) -> str:
    """Which tiers the files this rank read came from, nearest first: "memory",
    "replica" (a peer's copy kept in this node's memory), "staging" (the disk tier),
    "peer" (another node's memory), "durable", joined by "+" where they were several."""
    used = {id(reader.source(name)) for name in reader.files_read}
    names: list[str] = []
    for tier, store in tiers:
        if id(store) in used and tier not in names:
            names.append(tier)
        if isinstance(store, PeerStore) and id(store) in used and store.gone is not None:
            names.append("durable")  # what the peer did not send
    names = [n for n in names if n != "durable"] + (["durable"] if "durable" in names else [])
    return "+".join(names) or "durable"


def _nearest(tiers: Sequence[tuple[str, Store]], sources: str, durable: Store) -> Store:
    first = sources.split("+")[0]
    return next((store for tier, store in tiers if tier == first), durable)


def restore(
    state: MutableMapping[str, Any],
    *,
    durable: Store,
    staging: Store | None,
    group: Group,
    step: int | None = None,
    strict: bool = True,
    memory: Store | None = None,
    replicas: Sequence[Store] = (),
    peers: Sequence[PeerStore] = (),
) -> Restored | None:
    """Load the newest loadable committed checkpoint into ``state``; None if none exists.
    ``memory``: the node's memory tier, read before the disk tier ``staging`` (None: the
    durable tier alone, as a job that only reads it);
    ``replicas``: other ranks' copies this node's memory holds (``peers/``); ``peers``:
    other nodes' memory tiers, read after the node's own tiers, before ``durable``."""
    began = time.monotonic()
    node = _NodeTiers(memory, staging, tuple(replicas), tuple(peers))
    flat = collect(state)
    # Steps with a commit record, newest first, and the files present under each: one
    # listing of the durable tier (each manifest is read only when its step is tried).
    listed = agreed_listing(durable, group)
    agree_on_step(step, group, durable)
    steps = sorted(listed, reverse=True)
    if step is not None:
        if step not in steps:
            raise NoCheckpointError(
                f"no committed checkpoint of step {step} at {durable.url} "
                f"(committed steps: {sorted(steps) or 'none'})"
            )
        steps = [step]
    if not steps:
        return None
    problems: list[str] = []
    attempts: list[tuple[str, Store | _NodeTiers]] = [("durable", durable)]
    if node.tiers():
        attempts.insert(0, ("staging", node))
    for s in steps:
        reuse: _Prepared | None = None
        for tier, store in attempts:
            loaded = _try(
                state, flat, s, tier, store, durable, group, strict, problems, listed[s], reuse
            )
            if isinstance(loaded, _NoLocalCopy):
                reuse = loaded.prepared  # it read everything from the durable tier already
                continue
            if isinstance(loaded, _Failed):
                if loaded.durable_corrupt:
                    break
                continue
            manifest, reader = loaded
            tiers = [*node.tiers(), ("durable", durable)]
            sources = _sources(reader, tiers)
            where = _nearest(tiers, sources, durable).url_for(step_dir(s))
            newer = tuple(sorted(x for x in listed if x > s))
            return Restored(s, sources, where, time.monotonic() - began, manifest, newer)
        if s != steps[-1]:
            warnings.warn(
                f"checkpoint step {s} at {durable.url} could not be loaded; falling back to "
                f"the previous committed checkpoint ({'; '.join(problems[-2:])})",
                RuntimeWarning,
                stacklevel=3,
            )
    raise CheckpointCorruptError(
        f"no committed checkpoint at {durable.url} could be loaded: " + "; ".join(problems)
    )


def _try(
    state: MutableMapping[str, Any],
    flat: FlatState,
    step: int,
    tier: str,
    store: Store | _NodeTiers,
    durable: Store,
    group: Group,
    strict: bool,
    problems: list[str],
    durable_files: dict[str, int],
    reuse: _Prepared | None = None,
) -> tuple[Manifest, TierReader] | _Failed | _NoLocalCopy:
    """Load ``step`` from ``tier`` on every rank; ``_NoLocalCopy`` when the staging tier
    has nothing to offer (no rank holds a local file), ``_Failed`` when a copy was read and
    did not load. ``reuse``: that staging attempt's preparation, which read only the
    durable tier (its manifest, metadata and RNG state are not fetched again)."""
    prepared: _Prepared | None = None
    refused: NewerFormatError | None = None
    try:
        prepared = reuse or _prepare(flat, step, tier, store, durable, group, strict, durable_files)
        mine = _Attempt("ok", local_files=len(prepared.reader.nearby))
    except CheckpointMismatchError as e:
        mine = _Attempt("mismatch", str(e))
    except NewerFormatError as e:
        refused, mine = e, _Attempt("newer", str(e))
    except CheckpointCorruptError as e:
        mine = _Attempt("corrupt", str(e), durable_corrupt=_in_durable(e, durable, step))
    except Exception as e:
        mine = _Attempt("error", describe(e))
    attempts = group.all_gather(mine)
    verdicts = {a.verdict for a in attempts}
    messages = "; ".join(sorted({a.message for a in attempts if a.message}))
    if "newer" in verdicts:
        raise refused or NewerFormatError(messages, step=step)
    if "mismatch" in verdicts:
        raise CheckpointMismatchError(messages)
    if tier == "staging" and verdicts == {"ok"} and not any(a.local_files for a in attempts):
        assert prepared is not None
        return _NoLocalCopy(prepared)  # the durable attempt reads the same
    if verdicts != {"ok"}:
        in_durable = any(a.durable_corrupt for a in attempts)
        _fail(tier, step, store, durable, in_durable, messages, problems, "error" in verdicts)
        return _Failed(in_durable)
    assert prepared is not None
    manifest, reader, rng = prepared.manifest, prepared.reader, prepared.rng

    def load(part: dict[str, Any]) -> None:
        dcp.load(
            part,
            storage_reader=reader,
            planner=SafeLoadPlanner(allow_partial_load=not strict),
            process_group=group.pg,
            no_dist=group.pg is None,
        )

    try:
        restore_into(state, prepared.flat, prepared.values, load)
    except CheckpointException as e:
        raise_if_interrupted({r: f[0] for r, f in e.failures.items()}, group.rank, step)
        errors = [f[0] for f in e.failures.values()]
        for err in errors:
            if isinstance(err, CheckpointMismatchError):
                raise CheckpointMismatchError(str(err)) from e
        # Every rank holds every rank's failures here, so all decide alike.
        corrupt = [err for err in errors if isinstance(err, CheckpointCorruptError)]
        in_durable = any(_in_durable(err, durable, step) for err in corrupt)
        _fail(tier, step, store, durable, in_durable, describe(e), problems, not corrupt)
        return _Failed(in_durable)
    if rng is not None:
        apply_rng_state(rng)
        for name, generator in prepared.flat.generators.items():
            if name in rng.generators and name not in prepared.flat.nested:
                generator.set_state(rng.generators[name])
    elif group.rank >= manifest.world_size:
        shared = prepared.shared_generators
        for name, saved in shared.items():
            prepared.flat.generators[name].set_state(saved)
        own = sorted(
            n for n in prepared.flat.generators if n not in prepared.flat.nested and n not in shared
        )
        restored = f" (generators {sorted(shared)}, the same on every rank, are restored)"
        warnings.warn(
            f"rank {group.rank}: checkpoint step {step} was saved on {manifest.world_size} "
            "ranks and has no RNG state for this rank; its RNG streams"
            + (f" and generators {own}" if own else "")
            + " are left as they are"
            + (restored if shared else ""),
            RuntimeWarning,
            stacklevel=4,
        )
    tiers = [*(store.tiers() if isinstance(store, _NodeTiers) else []), ("durable", durable)]
    sources = _sources(reader, tiers)
    nearest = _nearest(tiers, sources, durable)
    log.info(
        "restored step %d from the %s tier (%s)", step, sources, nearest.url_for(step_dir(step))
    )
    return manifest, reader


def _in_durable(err: CheckpointCorruptError, durable: Store, step: int) -> bool:
    """Whether ``err`` was found in the durable tier's copy of ``step`` (its URL is there)."""
    where = durable.url_for(step_dir(step))
    return err.url is not None and (err.url == where or err.url.startswith(where + "/"))


def _fail(
    tier: str,
    step: int,
    store: Store | _NodeTiers,
    durable: Store,
    in_durable: bool,
    message: str,
    problems: list[str],
    hard: bool,
) -> None:
    """Record why (step, tier) did not load, naming the copy at fault (a staging attempt
    also reads the durable tier); a durable tier that errors (not corrupt) raises."""
    if in_durable or not isinstance(store, _NodeTiers):
        where = (durable if in_durable else store).url_for(step_dir(step))
    else:  # the file at fault may be a replica's or a peer's: the message names it
        kinds = ", ".join(dict.fromkeys(kind for kind, _ in store.tiers()))
        where = f"{step_dir(step)} on this node's copies ({kinds})"
    problems.append(f"{where}: {message}")
    if hard and tier == "durable":
        raise CheckpointError(f"reading checkpoint {where} failed: {message}")
    warnings.warn(f"checkpoint {where} is not usable: {message}", RuntimeWarning, stacklevel=4)


@dataclass(frozen=True)
class _NodeTiers:
    """The tiers nearer than the durable one, tried as one: each file from the nearest
    that holds it whole (the node's memory, the replicas it keeps, its disk, then the
    other nodes' memory), the rest from the durable tier."""

    memory: Store | None
    disk: Store | None
    replicas: tuple[Store, ...] = ()
    peers: tuple[PeerStore, ...] = ()

    def tiers(self) -> list[tuple[str, Store]]:
        own = [("memory", self.memory)] if self.memory is not None else []
        return [
            *own,
            *(("replica", r) for r in self.replicas),
            *([("staging", self.disk)] if self.disk is not None else []),
            *(("peer", p) for p in self.peers),
        ]

    def url_for(self, key: str) -> str:
        return self.tiers()[0][1].url_for(key)


@dataclass(frozen=True)
class _NoLocalCopy:
    """No rank's staging tier holds a file of the step: its preparation, which read the
    durable tier only, serves the durable attempt."""

    prepared: _Prepared


@dataclass(frozen=True)
class _Prepared:
    """Everything a (step, tier) attempt needs besides the tensor bytes, read and checked:
    nothing here can fail once the state starts to change."""

    manifest: Manifest
    reader: TierReader
    rng: RngState | None
    """This rank's RNG state, decoded; None where the checkpoint has none for this rank."""
    values: dict[str, Any]
    """The plain values, decoded."""
    flat: FlatState
    """The state to load into, its optimizers' state laid out as the checkpoint has it."""
    shared_generators: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """For a rank the checkpoint has no record of: the generators every saving rank
    held in the same state (a shared shuffle), rank 0's copy."""


def _prepare(
    flat: FlatState,
    step: int,
    tier: str,
    store: Store | _NodeTiers,
    durable: Store,
    group: Group,
    strict: bool,
    durable_files: dict[str, int],
) -> _Prepared:
    name = step_dir(step)
    manifest = read_manifest(durable, step)
    missing = missing_or_short(manifest, durable_files)
    if missing:  # a manifest without all its files: damaged, not a commit
        raise CheckpointCorruptError(
            f"{durable.url_for(name)} is incomplete: " + "; ".join(missing[:_SHOW]),
            step=step,
            url=durable.url_for(name),
        )
    values = saved_values(manifest, durable, group.global_rank)
    if isinstance(store, _NodeTiers):
        nearby: dict[str, Store] = {}
        for _, near in store.tiers():  # nearest first: a file is read from the first
            held = (
                near.held(step, manifest)
                if isinstance(near, PeerStore)
                else _local_files(near, name, manifest)
            )
            for fname in held:
                nearby.setdefault(fname, near)
        reader = TierReader(durable, step, manifest, nearby=nearby)
    else:
        reader = TierReader(durable, step, manifest)
    metadata = reader.read_metadata()
    rng = None
    if group.global_rank < manifest.world_size:
        rng = read_rng(reader, manifest, group.global_rank, durable)
    shared: dict[str, torch.Tensor] = {}
    if rng is None and _shared_generators(manifest, flat):
        rank0 = read_rng(reader, manifest, 0, durable)
        if rank0 is not None:
            shared = {n: rank0.generators[n] for n in _shared_generators(manifest, flat)}
            check_generators(flat, dataclasses.replace(rank0, generators=shared), False,
                              where=durable.url_for(f"{name}/{rng_file(0)}"))  # fmt: skip
    flat = _generators_of_older_checkpoints(flat, metadata.state_dict_metadata)
    other = other_optimizers(flat, metadata, manifest)
    refuse_other_optimizers(other, strict=strict, where=durable.url_for(name))
    flat = _without_entries(flat, other)
    flat = fit_to_saved(flat, metadata.state_dict_metadata)  # the optimizers' state as saved
    check_compatible(
        flat,
        metadata,
        manifest,
        strict=strict,
        where=durable.url_for(name),
    )
    rng_url = durable.url_for(f"{name}/{rng_file(group.global_rank)}")
    check_generators(flat, rng, strict, where=rng_url)
    return _Prepared(manifest, reader, rng, values, flat, shared)


def _without_entries(flat: FlatState, names: Collection[str]) -> FlatState:
    """``flat`` less the entries ``names``: a restore leaves them as they are."""
    if not names:
        return flat
    keys = {k for k, path in flat.paths.items() if path[0] in names}
    return dataclasses.replace(
        flat,
        tensors={k: v for k, v in flat.tensors.items() if k not in keys},
        kinds={n: k for n, k in flat.kinds.items() if n not in names},
        paths={k: p for k, p in flat.paths.items() if k not in keys},
        nested={n: v for n, v in flat.nested.items() if n not in names},
    )


def _shared_generators(manifest: Manifest, flat: FlatState) -> list[str]:
    """The state's generators that every saving rank held in the same state."""
    shared = manifest.extra.get("shared_generators", [])
    return [n for n in shared if n in flat.generators] if isinstance(shared, list) else []


def _generators_of_older_checkpoints(flat: FlatState, saved: Mapping[str, Any]) -> FlatState:
    """Generators that the checkpoint holds in DCP (an older unbroken's, one copy for
    every rank) are loaded from there; the others come from each rank's RNG record."""
    legacy = [n for n in flat.generators if n in saved and n not in flat.nested]
    if not legacy:
        return flat
    flat = dataclasses.replace(
        flat, tensors=dict(flat.tensors), paths=dict(flat.paths), nested=dict(flat.nested)
    )
    for name in legacy:
        load_generator_through_dcp(flat, name)
    return flat


def _local_files(store: Store, name: str, manifest: Manifest) -> frozenset[str]:
    """The files of ``manifest`` this rank's staging tier holds at their listed size, if
    its copy of the manifest equals the durable one (else none: a stale or foreign copy).

    Sizes only: every byte read is checked against its crc32c as it is read, and a local
    file that fails sends every rank on to the durable tier."""
    try:
        local = Manifest.from_json(store.read_bytes(f"{name}/{MANIFEST_NAME}"), where=store.url)
    except Exception as e:
        log.debug("step %s: no usable local manifest at %s (%s)", name, store.url, describe(e))
        return frozenset()
    if local != manifest:
        return frozenset()
    present = set()
    for rec in manifest.files.values():
        try:
            size = os.path.getsize(os.path.join(store.url, name, rec.name))
        except OSError:
            continue
        if size == rec.size:
            present.add(rec.name)
    return frozenset(present)
