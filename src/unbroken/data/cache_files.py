"""The cache directory on disk: names, fill locks, read pins, the byte ledger, sweeps.

Layout under ``root`` (nothing outside it is ever created, renamed or deleted)::

    objects/<2 hex>/<key hash>-<version hash>   published files, immutable
    objects/<2 hex>/.<name>.unbroken-tmp-<pid>-<rand>   fills in progress (temp files)
    locks/<name>.lock      exclusive flock held by the one process filling <name>
    plans/<pid>-<token>.plan / .cursor   each process's future access order
    usage                  8-byte ledger of bytes on disk, updated under flock

The version hash covers the source's size and etag, so a changed source has a new
name: it is a miss and is fetched afresh. The stale version is in no plan, so it is
among the first files evicted.

Locks are ``flock`` locks, which the kernel releases when their holder dies: a crashed
filler never blocks others, and its lock file is swept later. Readers hold a shared
``flock`` on the file while they read it (the pin); eviction takes an exclusive one
without waiting and skips the file when it cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import struct
from collections.abc import Iterator

from unbroken.data.eviction import Candidate
from unbroken.storage.base import is_temp_name, temp_name
from unbroken.storage.local import LocalStore

_LEDGER = struct.Struct("<q")
_LOCK_RECORD = struct.Struct("<16sq")  # holder pid (text, for people), bytes reserved
_RESERVED = struct.Struct("<q")
_RESERVED_AT = 16


def object_name(store_url: str, key: str, size: int, etag: str | None) -> str:
    """The cache file name of one version of one source object."""
    key_hash = hashlib.sha1(f"{store_url}\0{key}".encode()).hexdigest()[:32]
    version = hashlib.sha1(f"{size}\0{etag}".encode()).hexdigest()[:12]
    return f"{key_hash}-{version}"


class CacheLayout:
    """Paths and file-level operations inside one cache directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.objects = os.path.join(self.root, "objects")
        self.locks = os.path.join(self.root, "locks")
        self.plans = os.path.join(self.root, "plans")
        for d in (self.objects, self.locks, self.plans):
            os.makedirs(d, exist_ok=True)
        self._made: set[str] = set()
        self.crash_seen = False
        """Set when a fill lock left by a dead holder was taken over: the ledger may be off."""

    def object_path(self, name: str) -> str:
        return os.path.join(self.objects, name[:2], name)

    def shard_dir(self, name: str) -> str:
        """The directory of ``name``, created on first use."""
        directory = os.path.join(self.objects, name[:2])
        if directory not in self._made:
            os.makedirs(directory, exist_ok=True)
            self._made.add(directory)
        return directory

    def temp_path(self, name: str) -> str:
        return os.path.join(self.shard_dir(name), temp_name(name))

    # -- fill locks -------------------------------------------------------------------

    def try_lock(self, name: str) -> int | None:
        """Take the fill lock of ``name`` without waiting: a held fd, or None if busy."""
        path = os.path.join(self.locks, name + ".lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            if _same_file(fd, path):
                if os.pread(fd, 1, 0):  # a holder wrote here and never removed it: it died
                    self.crash_seen = True
                # the holder's pid (for people) and its reservation, none yet. No truncate:
                # on ext4 a truncate plus a write makes close() flush (auto_da_alloc)
                os.pwrite(fd, _LOCK_RECORD.pack(f"{os.getpid():<15}\n".encode(), 0), 0)
                return fd
            os.close(fd)  # the holder removed that lock file as we opened it: retry

    def set_reservation(self, fd: int, nbytes: int) -> None:
        """Record in a held fill lock the bytes the ledger counts for that fill."""
        os.pwrite(fd, _RESERVED.pack(nbytes), _RESERVED_AT)

    def held_reservations(self) -> int:
        """Bytes reserved by fills in progress: the sum over lock files someone holds."""
        total = 0
        for _path, fd, held in self._probe_locks():
            if held:  # a live fill (or an evictor, reserving 0)
                raw = os.pread(fd, _RESERVED.size, _RESERVED_AT)
                total += _RESERVED.unpack(raw)[0] if len(raw) == _RESERVED.size else 0
        return total

    def _probe_locks(self) -> Iterator[tuple[str, int, bool]]:
        """Each lock file, open, and whether a live process holds it (if not, we now do)."""
        for name in os.listdir(self.locks):
            path = os.path.join(self.locks, name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = False
                except BlockingIOError:
                    held = True
                yield path, fd, held
            finally:
                os.close(fd)

    def unlock(self, name: str, fd: int) -> None:
        """Release a fill lock taken by :meth:`try_lock` and remove its file."""
        try:
            os.unlink(os.path.join(self.locks, name + ".lock"))
        except FileNotFoundError:
            pass
        os.close(fd)

    # -- pinned reads and eviction -------------------------------------------------------

    def read_pinned(self, name: str, size: int) -> bytes | None:
        """The published file's bytes, read under a shared pin; None if absent or torn."""
        path = self.object_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # absent, or a symlink someone planted: a miss
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_size != size:  # damaged on disk: the fill replaces it
                return None
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            with contextlib.suppress(OSError):
                os.utime(fd)  # last use, for the LRU tie-breaker
            return data
        finally:
            os.close(fd)

    def pin(self, path: str) -> int:
        """Open ``path`` under a shared pin; the caller reads it and closes the fd."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    @staticmethod
    def read_fd(fd: int) -> bytes:
        with open(fd, "rb", closefd=False) as f:
            f.seek(0)
            return f.read()

    def size_on_disk(self, path: str) -> int:
        """Size of the regular file at ``path``; 0 if there is none."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def is_published(self, name: str, size: int) -> bool:
        try:
            st = os.stat(self.object_path(name), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def remove_if_unpinned(self, name: str, path: str | None = None) -> int | None:
        """Delete a published file unless a reader pins it; its size, or None if kept."""
        path = path or self.object_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, OSError):
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            if not _same_file(fd, path):
                return None
            size = os.fstat(fd).st_size
            os.unlink(path)
            return size
        finally:
            os.close(fd)

    def scan_objects(self) -> list[Candidate]:
        """Published regular files (never symlinks, never temp files) under objects/."""
        found = []
        for shard in _subdirs(self.objects):
            try:
                entries = list(os.scandir(os.path.join(self.objects, shard)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for e in entries:
                if is_temp_name(e.name):
                    continue
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append(Candidate(e.name, st.st_size, st.st_mtime))
        return found

    # -- crash leftovers ------------------------------------------------------------------

    def sweep_locks(self) -> int:
        """Remove lock files nobody holds: each marks a filler that died mid-fill."""
        removed = 0
        for path, fd, held in self._probe_locks():
            if not held and _same_file(fd, path):
                os.unlink(path)
                removed += 1
        return removed

    def sweep_temps(self) -> int:
        """Remove temp files whose filler process is dead (a walk of objects/)."""
        return LocalStore(self.objects).sweep_temp()

    def has_ledger(self) -> bool:
        return os.path.exists(os.path.join(self.root, "usage"))

    # -- the byte ledger ------------------------------------------------------------------

    @contextlib.contextmanager
    def ledger(self) -> Iterator[Ledger]:
        """The node-wide count of bytes on disk, locked for read-modify-write."""
        fd = os.open(os.path.join(self.root, "usage"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            ledger = Ledger(fd)
            yield ledger
            ledger.flush()
        finally:
            os.close(fd)


class Ledger:
    """Bytes the cache holds on disk (published + being filled); see CacheLayout.ledger."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        raw = os.pread(fd, _LEDGER.size, 0)
        self.used = _LEDGER.unpack(raw)[0] if len(raw) == _LEDGER.size else 0
        self._original = self.used

    def flush(self) -> None:
        if self.used != self._original:
            os.pwrite(self._fd, _LEDGER.pack(max(self.used, 0)), 0)


def _same_file(fd: int, path: str) -> bool:
    """True if ``fd`` is still the file at ``path`` (nobody unlinked or replaced it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _subdirs(directory: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
