"""Who uses a staging directory: one live process per rank, recorded in a lock file.

Why: the default staging_dir is derived from the URL, so two jobs saving to one URL on
one machine share it, and each deletes the other's step directories while tidying; the
loser saw bare FileNotFoundErrors. Each rank claims ``.<dir>.owners/rank-<r>`` beside
the directory (its pid and the process's start time) when its manager starts; a second
live claimant is refused by name. A claim whose process is gone (a crash, a kill -9) is taken over.
A claim of this very process (its pid and start time), not released yet, is refused
too (``open_managers`` closes an older manager on the dir before a new one claims it).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

from unbroken._util.procs import process_alive, process_start_ticks
from unbroken._util.staging_base import is_default_staging_dir
from unbroken.checkpoint.errors import CheckpointError


class StagingDirInUseError(CheckpointError):
    """Another live process claimed this staging directory for the same rank."""


def _holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _this_process(doc: dict) -> bool:
    """This process made the claim (its pid and start time) and has not released it."""
    pid = os.getpid()
    return doc.get("pid") == pid and doc.get("started") == process_start_ticks(pid)


def _alive(doc: dict) -> bool:
    pid = doc.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    return process_alive(pid, doc.get("started"))


def _in_use(staging_dir: str, rank: int, other: dict, purpose: str) -> str:
    theirs = other.get("purpose", "?")
    said = (
        f"staging_dir {staging_dir} is in use by pid {other['pid']} ({theirs}), rank "
        f"{rank}: two jobs share it"
    )
    if theirs == purpose:  # one URL: the default staging_dir is the URL's
        return (
            f"{said}, on one URL (the default staging_dir is derived from the URL). A job "
            "that only reads this URL (an evaluation beside the training) loads with "
            "unbroken.load(url, state), which needs no staging_dir; two jobs that save need "
            "a URL each"
        )
    return (
        f"{said}, with URLs of their own. Give each job its own staging_dir, or leave it "
        "unset (the default is one per URL); a job that only reads checkpoints loads "
        "with unbroken.load(url, state), which needs none"
    )


def claim_staging_dir(staging_dir: str, rank: int, purpose: str) -> Callable[[], None]:
    """Claim ``staging_dir`` for ``rank`` of this process; returns the release function.

    Raises StagingDirInUseError naming the other process if it is alive."""
    parent, base = os.path.split(os.path.abspath(staging_dir))
    folder = os.path.join(parent, f".{base}.owners")  # beside it: its listing stays the steps
    path = os.path.join(folder, f"rank-{rank:05d}")
    mine = {"pid": os.getpid(), "started": process_start_ticks(os.getpid()), "purpose": purpose}
    tmp = f"{path}.{os.getpid()}.tmp"
    for tries_left in (2, 1, 0):
        os.makedirs(folder, exist_ok=True)
        try:
            with open(tmp, "w") as f:
                json.dump(mine, f)
            break
        except FileNotFoundError:  # the last owner's release removed the folder just now
            if not tries_left:
                raise
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # exclusive: of two claimants, one links
                break
            except FileExistsError:
                other = _holder(path)
                if other is not None and _this_process(other):
                    raise StagingDirInUseError(
                        f"staging_dir {staging_dir} is still in use by another "
                        "CheckpointManager of this process: close it first (mgr.close(), "
                        "or a `with` block)"
                    ) from None
                if other is not None and _alive(other):
                    raise StagingDirInUseError(_in_use(staging_dir, rank, other, purpose)) from None
                try:  # its owner is gone: take over
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        else:
            raise StagingDirInUseError(f"could not claim staging_dir {staging_dir} for rank {rank}")
    finally:
        os.unlink(tmp)

    def release() -> None:
        holder = _holder(path)
        if holder is not None and holder.get("pid") == os.getpid():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        with contextlib.suppress(OSError):  # the last owner: no empty folder left behind
            os.rmdir(folder)
            if is_default_staging_dir(staging_dir):  # one of ours, empty (goodput's log
                os.rmdir(staging_dir)  # removes it at its end): gone too

    return release
