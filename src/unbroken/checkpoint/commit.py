"""The commit record: what the coordinator writes once every rank's files are durable.

A step counts only once its ``manifest.json`` is in the durable tier, written last. The
coordinator builds it from what every rank gathered (its file records, its plain values,
its RNG digests), writes it, and then checks that no other job's upload replaced a file
of the step meanwhile; if one did, it un-commits (the record is ours) and says who did.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from unbroken.checkpoint.durable_index import DurableIndex
from unbroken.checkpoint.errors import OtherJobError, SaveRefusedError
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    crc32c_bytes,
    new_manifest,
    step_dir,
    verify_committed_files,
    write_manifest,
)
from unbroken.checkpoint.format.writers import WRITER_NAME, describe_writer, writer_identity
from unbroken.checkpoint.json_values import rank_values
from unbroken.checkpoint.save_job import describe
from unbroken.storage import LocalStore, Store

log = logging.getLogger(__name__)

Outcome = tuple[str, Any]
"""``("ok", manifest JSON)``, ``("error", message)`` or ``("conflict", conflict_fields)``."""


def conflict_fields(exc: BaseException | None) -> dict[str, Any] | None:
    """A refused save's fields, to travel to every rank (see SaveRefusedError.fields)."""
    return exc.fields() if isinstance(exc, SaveRefusedError) else None


def generator_digests(rng: dict[str, Any]) -> dict[str, int]:
    """A checksum of each of the state's generators in this rank's RNG record."""
    return {name: crc32c_bytes(text.encode()) for name, text in rng.get("generators", {}).items()}


def commit_step(
    durable: Store,
    index: DurableIndex,
    step: int,
    world_size: int,
    values: dict[str, Any],
    gathered: list[Any],
) -> Outcome:
    """Coordinator: write step's manifest if every rank's files are durable. ``gathered``
    holds per rank ``(records, problem, etags, values, generator digests, conflict)``."""
    conflict = next((c for *_, c in gathered if c is not None), None)
    if conflict is not None:
        return ("conflict", conflict)
    bad = [f"rank {r}: {p}" for r, (_, p, *_) in enumerate(gathered) if p]
    if bad:
        return ("error", f"step {step} not committed: " + "; ".join(bad))
    files: dict[str, FileRecord] = {}
    etags: dict[str, str | None] = {}
    for rank, (records, _, rank_etags, *_) in enumerate(gathered):
        etags.update(rank_etags)
        for rec in records:
            if rec.name in files:
                return ("error", f"step {step}: rank {rank} wrote {rec.name} twice")
            files[rec.name] = rec
    extra = {
        "values": values,
        "rng_files": "rng/rank-{rank:05d}.json",
        "writer": writer_identity(),
        **_rank_values_entry(values, [g[3] for g in gathered]),
        **_shared_generators_entry([g[4] for g in gathered]),
    }
    try:
        manifest = new_manifest(step, world_size, files.values(), extra)
    except ValueError as e:  # a file name no manifest may hold
        return ("error", f"step {step} not committed: {e}")
    try:
        write_manifest(durable, manifest)
    except OtherJobError as e:
        conflict = conflict_fields(e)
        assert conflict is not None
        conflict["message"] += _overwritten_note(durable, manifest, etags)
        return ("conflict", conflict)
    except Exception as e:
        return ("error", f"step {step}: writing the commit record failed: {describe(e)}")
    changed = verify_committed_files(durable, manifest, etags)
    if changed:  # another job's upload landed over ours: un-commit (the record is ours)
        durable.delete(f"{step_dir(step)}/{MANIFEST_NAME}")
        me, other = describe_writer(writer_identity()), _claim_holder(durable, step)
        where = durable.url_for(step_dir(step))
        replaced = OtherJobError(
            f"two jobs are saving to one URL: step {step} not committed: "
            f"{', '.join(changed)} at {where} were replaced by the upload of {other} while "
            f"this job ({me}) committed. Give each job its own URL.",
            step=step,
            url=where,
            this_job=me,
            other_job=other,
        )
        return ("conflict", replaced.fields())
    if isinstance(durable, LocalStore):  # every rank's files are in: a dead writer's temp
        with contextlib.suppress(OSError):  # file in the step is a killed attempt's (a live
            durable.sweep_temp(step_dir(step))  # one's: another job's, told "two jobs")
    _remove_strays(durable, manifest)
    index.add(manifest)
    return ("ok", manifest.to_json())


def _remove_strays(durable: Store, manifest: Manifest) -> None:
    """Remove what a dead attempt left in a step this one took over and committed: files
    of names this attempt did not write (after a shrink, the shards and RNG states of its
    extra ranks). Unlisted, nothing reads or counts them, and no retention of a step kept
    for ever would remove them."""
    prefix = step_dir(manifest.step)
    keep = {*manifest.files, MANIFEST_NAME, WRITER_NAME}
    try:
        strays = [
            e.key
            for e in durable.list(prefix)
            if e.key.startswith(prefix + "/") and e.key[len(prefix) + 1 :] not in keep
        ]
        for key in strays:
            durable.delete(key)
    except Exception as exc:  # the commit stands; the strays cost only their bytes
        log.warning("step %d: files a dead attempt left in %s not removed: %s",
                    manifest.step, durable.url_for(prefix), describe(exc))  # fmt: skip
        return
    if strays:
        log.info("step %d: removed %d file(s) an earlier attempt left in %s (%s)",
                 manifest.step, len(strays), durable.url_for(prefix),
                 ", ".join(k[len(prefix) + 1 :] for k in strays[:5]))  # fmt: skip


def _rank_values_entry(values: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict:
    """``rank_values`` for the manifest where a rank's plain values differ from rank 0's."""
    own = rank_values(values, per_rank)
    return {"rank_values": own} if own else {}


def _shared_generators_entry(per_rank: list[dict[str, int]]) -> dict:
    """``shared_generators``: the generators every rank held in the same state (of two or
    more ranks; one rank cannot tell a shared one from its own): a rank added on a later
    restore gets those, and keeps its own state of the others."""
    if len(per_rank) < 2:
        return {}
    shared = sorted(n for n, d in per_rank[0].items() if all(r.get(n) == d for r in per_rank))
    return {"shared_generators": shared} if shared else {}


def _claim_holder(durable: Store, step: int) -> str:
    """Who the step's claim names now (the job whose upload replaced ours, if it took the
    claim over), as well as it can be read."""
    try:
        holder = json.loads(durable.read_bytes(f"{step_dir(step)}/{WRITER_NAME}"))
    except Exception:
        return "another writer"
    if holder == writer_identity():
        return "another writer"
    return describe_writer(holder)


def _overwritten_note(durable: Store, manifest: Manifest, etags: dict[str, str | None]) -> str:
    """For the job that lost a commit: did its uploads replace the winner's files?"""
    try:
        mine = [
            n for n, tag in etags.items()
            if tag is not None and durable.info(f"{step_dir(manifest.step)}/{n}").etag == tag
        ]  # fmt: skip
    except Exception:
        return ""
    if not mine:
        return ""
    return (
        f". This job's uploads replaced {', '.join(sorted(mine))} of that step: its "
        "checksums will not match and restore will fall back past it"
    )
