"""Spare shard files: superseded staging-tier files kept to be written over by the next save.

Every save writes each rank's whole shard to the staging tier, and retention deletes the
previous one. A new file needs new page-cache pages and new blocks; the deleted file's
pages go back to the free lists. Overwriting the old file in place reuses its blocks,
and its pages while they are still cached. It matters most in virtual machines whose
hypervisor takes freed guest memory back (free page reporting, ballooning): a page the
guest touches again then costs a host fault. Measured here: a new 1 GiB file 2.4 s of
CPU, a cached one written over 0.1 s. Limit: where idle memory is paged out (DAMON on
these machines, after about a minute), a spare idle that long costs nearly as much as a
new file (docs/arch/checkpoint.md, "Spare files"). PostgreSQL recycles its WAL
segments for similar reasons.

Peak disk use does not change: a save takes its spare before it writes, so the tier
still holds at most the committed copy and the one being written. Between saves the
spare stays on disk instead of being freed. One spare per file name, so the directory
is bounded by one checkpoint's worth of shards.
"""

from __future__ import annotations

import contextlib
import os
import shutil

SPARE_DIR = ".spare"
"""Name of the spares directory inside the staging tier (never a step directory)."""


class SpareFiles:
    """Files of superseded checkpoints, by name, waiting to be written over."""

    def __init__(self, staging_dir: str | os.PathLike) -> None:
        self.directory = os.path.join(os.fspath(staging_dir), SPARE_DIR)

    def keep(self, path: str | os.PathLike) -> bool:
        """Move the file at ``path`` into the spares under its own name.

        A spare of that name already there is replaced (one per name). Returns False,
        leaving ``path`` alone, when it cannot be moved.
        """
        path = os.fspath(path)
        try:
            os.makedirs(self.directory, exist_ok=True)
            os.replace(path, os.path.join(self.directory, os.path.basename(path)))
        except OSError:
            return False
        return True

    def take(self, name: str, destination: str | os.PathLike) -> bool:
        """Move the spare called ``name`` to ``destination``; False if there is none.

        The file keeps its old bytes: the caller writes over them from offset 0 and
        truncates to the new size.
        """
        try:
            os.rename(os.path.join(self.directory, name), os.fspath(destination))
        except OSError:  # no spare of that name (or it vanished): write a new file
            return False
        return True

    def clear(self) -> None:
        """Delete every spare (the job is done with this staging tier)."""
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.directory)
