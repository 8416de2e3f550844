"""A local file whose bytes are also still in memory, lent to one upload.

Why: a checkpoint shard is written to the local tier from host buffers, then uploaded.
Reading it back for the upload costs a second pass over the disk for every byte (on the
VMs this project runs on, disk I/O costs the training loop two to four times the CPU
the I/O thread is charged, in host-side work); a store that can send from memory
spares it. The memory belongs to someone else (the checkpoint's staging buffers, which
the next save reuses), so it is lent once: the store takes it for its first attempt
and gives it back as soon as it has read it, whether that attempt succeeds or not. A
retry reads the file, which holds the same bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


class FileInMemory:
    """The bytes of one local file as a sequence of buffers (their concatenation)."""

    def __init__(self, parts: Sequence[Any], on_returned: Callable[[], None] | None = None):
        """``parts``: bytes-like objects that must not change until given back.
        ``on_returned`` is called once, on the thread that gives them back."""
        self._parts: list[memoryview] | None = [memoryview(p).cast("B") for p in parts]
        self.size = sum(len(p) for p in self._parts)
        """Bytes in all parts together."""
        self._on_returned = on_returned
        self._taken = False
        self._lock = threading.Lock()
        self.sent_from_memory = False
        """True once a store has read all the parts (and written them, not the file)."""

    @property
    def returned(self) -> bool:
        return self._parts is None

    def take(self) -> list[memoryview] | None:
        """The parts, to the first caller only (None later, or once given back)."""
        with self._lock:
            if self._taken or self._parts is None:
                return None
            self._taken = True
            return self._parts

    def give_back(self, *, read_all: bool = False) -> None:
        """The parts are no longer read (idempotent); tells the lender once.

        ``read_all``: the taker read every part (sets ``sent_from_memory``)."""
        with self._lock:
            if self._parts is None:
                return
            self._parts = None
            self.sent_from_memory = read_all and self._taken
        if self._on_returned is not None:
            self._on_returned()
