"""Spare shard files: superseded staging-tier files kept to be written over by the next save.

Every save writes each rank's whole shard to the staging tier, and retention deletes the
previous one. A new file needs new page-cache pages; the deleted file's pages go back to
the free lists. Overwriting the old file in place reuses pages that are already there:
no allocation, no zeroing, no new disk blocks. It matters most in virtual machines whose
hypervisor takes freed guest memory back (free page reporting, ballooning): a page the
guest touches again then costs a host fault, and writing a new file was measured at
2.6 s of CPU per GiB on such a machine against 0.12 s for overwriting a cached one
(docs/arch/checkpoint.md, "Spare files"). PostgreSQL recycles its WAL segments for the
same reason.

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
        leaving ``path`` alone, when it cannot be moved (then the caller deletes it).
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
