"""One rank's event log of one attempt, as a file on the node.

``<staging>/_goodput/attempt-<id>-rank-<r>.jsonl``, appended every second (to the page
cache: it outlives the process, not the node). It holds what the durable tier may not
have yet: a rank that writes durably only at its end reads its steps back from here, and
the next attempt on the node uploads a dead process's tail (``salvage.py``).

A write that fails (a full staging disk) stops the copy for the rest of the attempt,
with a warning, its file closed: from then on the file may lack events, so the log keeps
in memory what the durable tier does not have yet.
"""

from __future__ import annotations

import logging
import os
from typing import BinaryIO

from unbroken._util.staging_base import is_default_staging_dir

log = logging.getLogger(__name__)


class LocalCopy:
    """The node's file of one (attempt, rank) log: appends, and reads from an offset."""

    def __init__(self, directory: str, attempt: str, rank: int) -> None:
        self.dir = directory
        self.path = os.path.join(directory, f"attempt-{attempt}-rank-{rank}.jsonl")
        self.nbytes = 0
        """Bytes in the file: the offset the next append lands at."""
        self.stopped = False
        """True once an append failed: the file is not appended to any more."""
        self._file: BinaryIO | None = None

    @property
    def opened(self) -> bool:
        return self._file is not None

    def append(self, data: bytes) -> bool:
        """Append ``data``; False if the copy is stopped (now or before)."""
        if self.stopped:
            return False
        try:
            if self._file is None:
                os.makedirs(self.dir, exist_ok=True)
                self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
                self.nbytes = self._file.tell()
            self._file.write(data)
            self._file.flush()
        except (OSError, ValueError) as exc:
            log.warning("goodput: no local copy of the event log from now on (%s)", exc)
            self.stopped = True
            self.close()
            return False
        self.nbytes += len(data)
        return True

    def read(self, at: int = 0) -> bytes:
        """The file's bytes from offset ``at`` on (OSError if it is gone)."""
        with open(self.path, "rb") as f:
            f.seek(at)
            return f.read()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # its buffer could not be written: nothing more to lose
                pass
            self._file = None

    def remove(self) -> None:
        """Delete the file, and the folder once no other rank's file is left in it (and
        a default staging dir holding nothing else)."""
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            return
        try:
            os.rmdir(self.dir)  # only if empty: other ranks' logs stay
            if is_default_staging_dir(staging := os.path.dirname(self.dir)):
                os.rmdir(staging)  # one unbroken chose, if nothing else is there
        except OSError:
            pass
