"""Staging buffers that already are the memory tier's next shard file.

Without them a save holds the state three times over in host memory: the staging
buffers, the tier's committed copy, and the copy being written from those buffers. An
arena is a file in the memory tier laid out as this rank's next shard
(``format/shard_layout.py``); the staging copy writes each tensor straight into its
record's payload, and the local write only adds the envelopes and the values, then links
the file into the step's directory. The node's copy and the staging buffers are then the
same pages: one committed snapshot plus the one being written, as the tier promises.

An arena is free while no snapshot is staged in it and no step directory links it: the
link count records the step's hold, so it stays right across failures, restarts and
another rank's tidy (which unlinks a step's files as it always has). The pipeline's
worker makes arenas (``prepare``, after a save's local write, with that save's layout),
their pages allocated up front so that a full tmpfs is an error there and never a
SIGBUS in the copy; ``take`` only hands out one that is ready. A rank keeps at most
``ARENAS_PER_RANK``; a save that finds none free stages into private buffers, as without
arenas.

Pages are page-locked for CUDA sources where CUDA is there (``cudaHostRegister``), so the
side stream's copies stay asynchronous; an arena that cannot be registered takes no CUDA
source (those keep their pinned private buffers).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Mapping

import torch

from unbroken._util.direct_io import address_of
from unbroken._util.procs import pid_alive
from unbroken._util.sizes import format_size
from unbroken.checkpoint.format.shard_layout import TensorLayout
from unbroken.checkpoint.memory_tier import space

log = logging.getLogger(__name__)

ARENAS_DIR = ".arenas"
"""The arenas' folder inside a memory tier's directory."""
ARENAS_PER_RANK = 2
"""The committed snapshot's and the one being written."""
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: map every page now (Python 3.11's mmap module does not name it)."""


class Arena:
    """One file of the memory tier, mapped, laid out as ``layout``'s tensor records."""

    def __init__(self, path: str, layout: TensorLayout) -> None:
        self.path = path
        self.layout = layout
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, layout.end)  # ENOSPC here, not SIGBUS in the copy
            self._map = mmap.mmap(fd, layout.end, mmap.MAP_SHARED)
            with contextlib.suppress(OSError):  # the copy then takes no page fault (an
                self._map.madvise(MADV_POPULATE_WRITE)  # older kernel: it takes them)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self.fd = fd
        self._ino = os.fstat(fd).st_ino
        self._registered = False
        self._register_failed = False
        self.busy = False
        """A snapshot is staged in it (from ``take`` until its ``StagedState`` is released)."""

    @property
    def free(self) -> bool:
        """No snapshot is staged in it and no step directory links it (and it is still
        ours under its name)."""
        if self.busy:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_ino == self._ino and st.st_nlink == 1

    def release(self) -> None:
        """The snapshot staged in it is done with: its step's link (if the save made one)
        holds it from now on."""
        self.busy = False

    def views(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype, bool]]) -> dict:
        """A tensor over its record's payload for each key whose ``(shape, dtype, cuda)``
        matches its slot; keys that do not match get none (they stage privately)."""
        slots = self.layout.by_fqn()
        out: dict[str, torch.Tensor] = {}
        for key, (shape, dtype, cuda) in specs.items():
            slot = slots.get(key)
            if slot is None or slot.shape != tuple(shape) or slot.dtype != dtype:
                continue
            if slot.payload_bytes == 0 or (cuda and not self._pinned()):
                continue
            flat = torch.frombuffer(
                self._map, dtype=torch.uint8, count=slot.payload_bytes, offset=slot.payload_start
            )
            out[key] = flat.view(dtype).view(shape)
        return out

    def reset(self) -> None:
        """Drop the values a last use appended after the tensor records."""
        os.ftruncate(self.fd, self.layout.end)

    def link(self, path: str) -> None:
        """Make the file (written whole) appear at ``path``, replacing what was there."""
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.link"
        os.link(self.path, tmp)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def discard(self) -> None:
        """Give a free arena's pages back at once, then close it. Views a released
        snapshot still holds keep the mapping, and would keep the pages too: they read
        zeros from here on (nothing reads them; a stray read finds no other save's bytes)."""
        if self.free:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(mmap.MADV_REMOVE)
        self.close()

    def close(self) -> None:
        """Remove the arena's own name; a step that links it keeps its bytes. The mapping
        goes once no tensor over it is left (each view holds the map): it is never
        unmapped under a view."""
        if self._registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.address)
            self._registered = False
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process."""
        return address_of(memoryview(self._map))

    def _pinned(self) -> bool:
        """Page-lock the mapping for CUDA's copies; False where that cannot be done."""
        if self._registered or self._register_failed:
            return self._registered
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA")
            err = torch.cuda.cudart().cudaHostRegister(self.address, self.layout.end, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")
            self._registered = True
        except Exception as e:
            self._register_failed = True
            log.info("arena %s not page-locked (%s): CUDA sources stage apart", self.path, e)
        return self._registered


class RankArenas:
    """A rank's arenas in one memory tier: at most ``ARENAS_PER_RANK``, reused while free.

    ``take`` runs on the training thread, ``prepare`` and ``drop_free`` on the
    pipeline's worker."""

    def __init__(self, tier_path: str, rank: int) -> None:
        self.directory = os.path.join(tier_path, ARENAS_DIR)
        self.rank = rank
        self._arenas: list[Arena] = []
        self._lock = threading.Lock()
        self._told = False
        self._remove_leftovers()

    @property
    def nbytes(self) -> int:
        return sum(a.layout.end for a in self._arenas)

    def take(self, layout: TensorLayout | None) -> Arena | None:
        """A free arena laid out as ``layout``, busy until released; None without a
        layout, or while none is free."""
        if layout is None or not layout.slots:
            return None
        with self._lock:
            for arena in self._arenas:
                if arena.layout == layout and arena.free:
                    arena.busy = True
                    arena.reset()
                    return arena
        return None

    def prepare(self, layout: TensorLayout | None, *, spare: bool = True) -> bool:
        """Make the arenas the next saves of ``layout`` can take: free ones of another
        layout go, and one more is made while the rank has fewer than its two. A tmpfs
        without room for one is said once; saves then stage apart. False when the make
        failed. ``spare`` False: make one only while none of ``layout`` exists (after a
        save's local write, the older step's copy is still in the tier until the commit:
        a spare made then would be a third copy of the state)."""
        if layout is None or not layout.slots:
            self.drop_free()
            return True
        with self._lock:
            gone = [a for a in self._arenas if not a.busy and not os.path.exists(a.path)]
            for arena in gone:  # its name was removed (a sweep): it can never be free again
                self._drop(arena)
            for arena in [a for a in self._arenas if a.layout != layout and a.free]:
                self._drop(arena)
            if len(self._arenas) >= ARENAS_PER_RANK:
                return True
            if any(a.layout == layout and a.free for a in self._arenas):
                return True  # one is ready: a second is made once this one holds a step
            if not spare and any(a.layout == layout for a in self._arenas):
                return True
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                room = space(self.directory)
                if not room.room_for(layout.end):  # an arena is the next save's copy
                    raise OSError(
                        f"{format_size(layout.end)} would leave less than "
                        f"{format_size(room.reserve)} free ({format_size(room.free)} free)"
                    )
                name = f"r{self.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                self._arenas.append(Arena(os.path.join(self.directory, name), layout))
                return True
            except OSError as e:
                if not self._told:
                    self._told = True
                    log.warning(
                        "memory tier %s: no room to stage the next saves in place (%s); "
                        "they stage into private buffers",
                        self.directory,
                        e,
                    )
                return False

    def drop_free(self) -> None:
        """Give back the free arenas' memory (saves no longer go to the memory tier)."""
        with self._lock:
            for arena in [a for a in self._arenas if a.free]:
                self._drop(arena)

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas:
                arena.close()
            self._arenas = []

    def _drop(self, arena: Arena) -> None:
        arena.discard()
        self._arenas.remove(arena)

    def _remove_leftovers(self) -> None:
        """Arena names an earlier process of this rank left (it was killed), and those of
        any process no longer alive (a restart with other ranks on this node); a step
        that links one keeps its bytes under the step's name."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            parts = name.split("-")
            pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
            ours = parts[0] == f"r{self.rank}"
            if ours or pid is None or not pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
