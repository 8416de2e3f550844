"""Each filling process's reserved bytes, in one small record file per process."""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from collections.abc import Iterator

from unbroken.data.cache.range_locks import range_held, range_lock

_RESERVED = struct.Struct("<q")


class FillerRecords:
    """Bytes reserved by each process's fills in progress: one small file per process.

    A process creates its record at its first reservation and keeps byte 0 of it
    locked (an OFD lock) while it lives; the kernel drops the lock when it dies. A
    recount adds the reservations of live records; an unlocked record with bytes
    reserved is the mark of a filler that died mid-fill. Every change happens under
    the ledger's lock, so records, ledger and disk always agree.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.reserved = 0
        """Bytes this process's fills hold right now (what its record says)."""
        self._fd: int | None = None
        self._pid = 0
        self._path = ""

    def add(self, nbytes: int) -> None:
        """Change this process's reservation by ``nbytes``. Call under the ledger lock."""
        if self._fd is None or self._pid != os.getpid():
            self._create()
        elif os.fstat(self._fd).st_nlink == 0:  # removed from outside (rm, a tmp cleaner):
            self._recreate()  # unseen, its bytes would drop out of every recount
        value = self.reserved + nbytes
        os.pwrite(self._fd, _RESERVED.pack(value), 0)
        self.reserved = value

    def _create(self) -> None:
        os.makedirs(self.directory, exist_ok=True)  # removed from outside: made again
        path = os.path.join(self.directory, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, _RESERVED.pack(0), 0)  # never an empty record
            if not range_lock(fd, 0):
                raise OSError(f"cannot lock the new filler record {path}")
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        self._fd, self._pid, self._path, self.reserved = fd, os.getpid(), path, 0

    def _recreate(self) -> None:
        held = self.reserved
        os.close(self._fd)
        self._fd = None
        self._create()
        os.pwrite(self._fd, _RESERVED.pack(held), 0)
        self.reserved = held

    @property
    def held(self) -> bool:
        """Whether this process has a record open."""
        return self._fd is not None and self._pid == os.getpid()

    def release(self) -> None:
        """Remove this process's record if no fill holds bytes. Call under the ledger lock."""
        if self._fd is not None and self._pid == os.getpid() and self.reserved == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = None

    def after_fork(self) -> None:
        if self._fd is not None and self._pid != os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)  # the parent's lock lives on in the parent's copy
            self._fd = None
            self.reserved = 0

    def scan(self) -> Iterator[tuple[str, bool, int]]:
        """(path, alive, bytes reserved) of every record."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                raw = os.pread(fd, _RESERVED.size, 0)
                reserved = _RESERVED.unpack(raw)[0] if len(raw) == _RESERVED.size else 0
                yield path, range_held(fd, 0), reserved
            finally:
                os.close(fd)

    def live_reserved(self) -> int:
        """Bytes reserved by the fills of live processes."""
        return sum(reserved for _, alive, reserved in self.scan() if alive)

    def dead_reserved(self) -> int:
        """Bytes still reserved in the records of dead processes: > 0 after a crash."""
        return sum(reserved for _, alive, reserved in self.scan() if not alive)

    def sweep_dead(self) -> tuple[int, int]:
        """Remove dead processes' records: (records that held bytes, bytes they held)."""
        crashed = held = 0
        for path, alive, reserved in list(self.scan()):
            if alive:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if reserved:
                crashed += 1
                held += reserved
        return crashed, held
