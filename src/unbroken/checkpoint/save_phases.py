"""How the phases of a save fail together: one collective each, one verdict for all ranks.

A phase that fails on any rank fails on every rank, so no rank waits in a collective
its peers never reach. A failure that never heals (a refused save) travels as the plain
fields of its SaveRefusedError, for the manager to raise, not warn about.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unbroken._util.collectives import Group
from unbroken.checkpoint.commit import Outcome, conflict_fields
from unbroken.checkpoint.errors import StepsDisagreeError
from unbroken.checkpoint.format.manifest import FileRecord, read_manifest
from unbroken.checkpoint.save_job import describe
from unbroken.storage import Store


class PhaseFailed(Exception):
    """A phase failed on some rank; ``args[0]`` says where and why, ``conflict`` (the
    fields of a SaveRefusedError, as every rank got them) that it never heals."""

    def __init__(self, message: str, conflict: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.conflict = conflict


def together(what: str, collective: Callable[[Any], Any], obj: Any) -> Any:
    """One collective of a save. Its failure (a peer crashed, was killed, or is stuck past
    the timeout) fails the save like any phase, reported once, no traceback."""
    try:
        return collective(obj)
    except Exception as e:
        raise PhaseFailed(
            f"{what}: the ranks could not agree, a peer is gone or stuck ({describe(e)})"
        ) from e


def agree_to_stage(
    group: Group, url: str, step: int, problem: str | None, exc: BaseException | None
) -> None:
    """Raise on every rank if ``problem`` is set on any rank (``exc``: this rank's), or if
    the ranks are saving different steps."""
    what = f"starting the save of step {step}"  # staged, checked, claimed
    gathered = together(what, group.all_gather, (step, problem, conflict_fields(exc)))
    steps = [s for s, _, _ in gathered]
    if len(set(steps)) > 1:
        disagree = StepsDisagreeError.of(steps, url)
        raise PhaseFailed(str(disagree), disagree.fields()) from exc
    conflict = next((c for _, _, c in gathered if c is not None), None)
    if conflict is not None:
        raise PhaseFailed(conflict["message"], conflict) from exc
    bad = [f"rank {r}: {p}" for r, (_, p, _) in enumerate(gathered) if p]
    if bad:
        raise PhaseFailed(f"{what} failed: " + "; ".join(bad)) from exc


def recorded_outcome(
    durable: Store, step: int, records: list[FileRecord], outcome: Outcome | None
) -> Outcome | None:
    """After the outcome's broadcast failed (a peer died): the step stands if its commit
    record is written and holds this rank's files as this rank uploaded them. The
    coordinator knows its own outcome; another rank reads the record. None: the step is
    not committed, or nothing says it is."""
    if outcome is not None:
        return outcome if outcome[0] == "ok" else None
    try:
        manifest = read_manifest(durable, step)
    except Exception:  # absent, unreadable, the store down: nothing says it is
        return None
    if not records or any(manifest.files.get(rec.name) != rec for rec in records):
        return None
    return ("ok", manifest.to_json())
