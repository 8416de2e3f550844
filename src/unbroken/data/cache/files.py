"""The cache directory on disk: names, fill locks, read pins, the byte ledger, sweeps.

Layout under ``root`` (nothing outside it is ever created, renamed or deleted)::

    objects/<2 hex>/<key hash>-<version hash>   published files, immutable
    objects/<2 hex>/.<name>.unbroken-tmp-fill   the fill of <name> in progress
    fill.locks             one byte-range lock per name, held by the one process filling it
    fillers/<pid>-<token>  each filling process's reserved bytes, locked while it lives
    plans/<pid>-<token>.plan / .cursor   each process's future access order
    usage                  8-byte ledger of bytes on disk, updated under flock

The version hash covers the source's size and etag, so a changed source has a new
name: it is a miss and is fetched afresh. The stale version is in no plan, so it is
among the first files evicted.

A fill creates exactly one file (its temp file, renamed into place) and deletes none.
Fill locks are open-file-description byte-range locks (Linux ``F_OFD_SETLK``) at a
hash of the name in one shared file, not a lock file per fill: on ext4 without a
journal every new inode is placed past all inodes freed in the last minute, so a
create-and-unlink per fill makes each later create slower (quadratic over an epoch).
The kernel drops a dead holder's locks, so a crash never blocks anyone; its temp file
(fixed name) and its record under ``fillers/`` are the evidence that it died. Readers
hold a shared ``flock`` on the file while they read it (the pin); eviction takes an
exclusive one without waiting and skips the file when it cannot.

Fill locks, pins and filler records belong to an open file description, which a forked
child (a DataLoader worker) shares with its parent: a copy kept by the child would hold
a lock or a pin after the parent let go, for as long as the worker lives (a pin: a file
that can never be evicted). A parent thread may be anywhere between opening such a
descriptor and closing it when another thread forks, so the child closes every
descriptor it inherited into the cache (``close_inherited``), found through /proc
rather than from a registry that a fork could split from the open.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterable, Iterator

from unbroken._util.fileio import pread_exactly
from unbroken.data.cache.eviction import Candidate
from unbroken.data.cache.filler_records import FillerRecords
from unbroken.data.cache.range_locks import lock_offset, range_lock, require_range_locks
from unbroken.storage.base import TEMP_MARKER, is_temp_name

_LEDGER = struct.Struct("<q")
_FILL_SUFFIX = TEMP_MARKER + "fill"

log = logging.getLogger(__name__)


def object_name(store_url: str, key: str, size: int, etag: str | None) -> str:
    """The cache file name of one version of one source object."""
    key_hash = hashlib.sha1(f"{store_url}\0{key}".encode()).hexdigest()[:32]
    version = hashlib.sha1(f"{size}\0{etag}".encode()).hexdigest()[:12]
    return f"{key_hash}-{version}"


class CacheLayout:
    """Paths and file-level operations inside one cache directory."""

    def __init__(self, root: str) -> None:
        require_range_locks()
        self.root = os.path.abspath(os.path.expanduser(root))
        self.objects = os.path.join(self.root, "objects")
        self.plans = os.path.join(self.root, "plans")
        for d in (self.objects, self.plans):
            os.makedirs(d, exist_ok=True)
        self.fill_locks = os.path.join(self.root, "fill.locks")
        os.close(os.open(self.fill_locks, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        self.fillers = FillerRecords(os.path.join(self.root, "fillers"))
        self._made: set[str] = set()
        # as /proc names them: each resolved on its own (objects/ may link to a bigger disk)
        self.inherited_dirs = tuple(
            os.path.realpath(d) for d in (self.objects, self.fillers.directory)
        )
        self.inherited_files = tuple(
            os.path.realpath(os.path.join(self.root, f)) for f in ("fill.locks", "usage")
        )
        self._ledger_fd: int | None = None
        self._ledger_pid = 0
        self._ledger_mutex = threading.Lock()
        self.crash_seen = False
        """Set when a fill found the temp file of a dead filler: the ledger may be off."""

    def __del__(self) -> None:  # a dataset dropped: its ledger descriptor goes with it
        fd, pid = getattr(self, "_ledger_fd", None), getattr(self, "_ledger_pid", 0)
        if fd is not None and pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(fd)

    def after_fork(self) -> None:
        """In a forked child: close and forget the parent's ledger handle and record.
        What its threads held open besides goes in :func:`close_inherited`."""
        if self._ledger_fd is not None and self._ledger_pid != os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._ledger_fd)
        self._ledger_fd = None
        self._ledger_mutex = threading.Lock()
        self.fillers.after_fork()

    def object_path(self, name: str) -> str:
        return os.path.join(self.objects, name[:2], name)

    def shard_dir(self, name: str) -> str:
        """The directory of ``name``, created on first use."""
        directory = os.path.join(self.objects, name[:2])
        if directory not in self._made:
            os.makedirs(directory, exist_ok=True)
            self._made.add(directory)
        return directory

    def shard_removed(self, name: str) -> bool:
        """Whether ``name``'s folder was removed from outside (an age-based cleaner) while
        the cache itself stands; it is made again at its next use."""
        directory = os.path.join(self.objects, name[:2])
        if os.path.isdir(directory) or not os.path.exists(self.fill_locks):
            return False
        self._made.discard(directory)
        return True

    def temp_path(self, name: str) -> str:
        """The one temp path of ``name``: only the holder of its fill lock writes it."""
        return os.path.join(self.shard_dir(name), f".{name}{_FILL_SUFFIX}")

    def create_temp(self, name: str) -> tuple[str, int]:
        """Create the temp file of ``name`` (fill lock held): its path and an open fd.

        Finding one already there means its last filler died mid-fill: the leftover is
        replaced and :attr:`crash_seen` is set, so the caller recounts the ledger.
        """
        path = self.temp_path(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # its directory was removed (an age-based cleaner)
            self._made.discard(os.path.dirname(path))
            fd = os.open(self.temp_path(name), flags, 0o644)
        except FileExistsError:
            self.crash_seen = True
            self._remove_temps_of(name)  # we hold its lock: every temp of it is stale
            fd = os.open(path, flags, 0o644)
        # a child forked while this is open closes its copy (after_fork): kept, it would
        # hold the file's blocks on disk after an eviction, past what the ledger counts
        return path, fd

    def close_temp(self, fd: int) -> None:
        """Close a temp file's fd from :meth:`create_temp`."""
        os.close(fd)

    def _remove_temps_of(self, name: str) -> None:
        """Remove ``name``'s temp file and any download temp beside it (``..<name>...``)."""
        directory = self.shard_dir(name)
        for entry in os.listdir(directory):
            if is_temp_name(entry) and _temp_owner(entry) == name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, entry))

    # -- fill locks -------------------------------------------------------------------

    def try_lock(self, name: str) -> int | None:
        """Take the fill lock of ``name`` without waiting: a held fd, or None if busy.

        Each call opens its own file description, so the lock also excludes the other
        threads of this process.
        """
        fd = os.open(self.fill_locks, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            locked = range_lock(fd, lock_offset(name))
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            return None
        return fd

    def unlock(self, name: str, fd: int) -> None:
        """Release a fill lock taken by :meth:`try_lock` (closing its description does)."""
        os.close(fd)

    # -- pinned reads and eviction -------------------------------------------------------

    def read_pinned(self, name: str, size: int, touch: bool = True) -> bytes | None:
        """The published file's bytes, read under a shared pin; None if absent or torn.

        ``touch`` refreshes its mtime, the LRU tie-breaker of eviction.
        """
        path = self.object_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # absent, or a symlink someone planted: a miss
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_size != size:  # damaged on disk: the fill replaces it
                return None
            data = pread_exactly(fd, size)
            if touch:
                with contextlib.suppress(OSError):
                    os.utime(fd)
            return data
        finally:
            os.close(fd)

    def pin(self, path: str) -> int:
        """Open ``path`` under a shared pin; the caller reads it and closes the fd."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def read_fd(fd: int) -> bytes:
        return pread_exactly(fd, os.fstat(fd).st_size)

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

    def sweep_temps(self) -> int:
        """Remove temp files nobody is filling (a walk of objects/, only after a crash).

        A temp file is live exactly while its name's fill lock is held; an older
        temp name with a pid in it is judged the same way.
        """
        removed = 0
        for shard in _subdirs(self.objects):
            directory = os.path.join(self.objects, shard)
            try:
                names = os.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for temp in names:
                if not is_temp_name(temp):
                    continue
                fd = self.try_lock(_temp_owner(temp))
                if fd is None:
                    continue  # its filler is alive
                try:
                    os.unlink(os.path.join(directory, temp))
                    removed += 1
                except FileNotFoundError:
                    pass
                finally:
                    self.unlock(temp, fd)
        return removed

    def has_ledger(self) -> bool:
        return os.path.exists(os.path.join(self.root, "usage"))

    # -- the byte ledger ------------------------------------------------------------------

    @contextlib.contextmanager
    def ledger(self) -> Iterator[Ledger]:
        """The node-wide count of bytes on disk, locked for read-modify-write.

        One descriptor per process, locked with ``flock`` against other processes and
        with a mutex against this process's other threads (they share the descriptor).
        """
        with self._ledger_mutex:
            fd = self._ledger_file()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:  # removed from outside (rm of the cache's files)
                fcntl.flock(fd, fcntl.LOCK_UN)  # the node's processes meet at the new one
                os.close(fd)
                self._ledger_fd = None
                fd = self._ledger_file()
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                ledger = Ledger(fd)
                if ledger.new:  # made just now: what the disk holds (as a cache opened)
                    ledger.used = sum(c.size for c in self.scan_objects())
                    ledger.used += self.fillers.live_reserved()
                try:
                    yield ledger
                finally:  # callers count each disk change once it is done, so keep them
                    ledger.flush()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _ledger_file(self) -> int:
        if self._ledger_fd is None or self._ledger_pid != os.getpid():
            path = os.path.join(self.root, "usage")
            self._ledger_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._ledger_pid = os.getpid()
        return self._ledger_fd

    def end_fills(self) -> None:
        """This process's fills are over for now (a fill ahead closed with its epoch or
        its loader): its record goes, so a loader dropped keeps no descriptor nor file
        open; the next fill makes one again."""
        if self.fillers.held:
            with self.ledger():
                self.fillers.release()
            self.close()

    def close(self) -> None:
        """Close this process's ledger descriptor (reopened on next use)."""
        with self._ledger_mutex:
            if self._ledger_fd is not None and self._ledger_pid == os.getpid():
                os.close(self._ledger_fd)
            self._ledger_fd = None

    def check_boot(self, ledger: Ledger) -> bool:
        """Drop every cached file if the machine restarted since the cache was used.

        Fills are not fsynced, so after a power loss a file can have its full size and
        zeroed blocks, which no size check catches. A restart is told by the kernel's
        boot id, recorded in the cache. Call under the ledger lock; True if files went.
        """
        boot = _boot_id()
        if boot is None:
            return False
        path = os.path.join(self.root, "boot_id")
        try:
            with open(path) as f:
                recorded = f.read().strip()
        except FileNotFoundError:
            recorded = None
        if recorded == boot:
            return False
        dropped = 0
        if recorded is not None:  # a cache from before a restart: nothing in it is trusted
            for c in self.scan_objects():
                size = self.remove_if_unpinned(c.name)
                if size is not None:
                    ledger.used -= size
                    dropped += 1
            if dropped:
                log.warning(
                    "unbroken cache %s: the machine restarted since it was filled; dropped "
                    "%d cached files (unsynced copies cannot be trusted after a power loss)",
                    self.root,
                    dropped,
                )
        tmp = path + f"{TEMP_MARKER}{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(boot)
        os.replace(tmp, path)
        return dropped > 0


class Ledger:
    """Bytes the cache holds on disk (published + being filled); see CacheLayout.ledger."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        raw = os.pread(fd, _LEDGER.size, 0)
        self.new = len(raw) < _LEDGER.size
        """The file was empty: no process has counted into it yet."""
        self.used = 0 if self.new else _LEDGER.unpack(raw)[0]
        self._original = None if self.new else self.used

    def flush(self) -> None:
        if self.used != self._original:
            os.pwrite(self._fd, _LEDGER.pack(max(self.used, 0)), 0)


def _boot_id() -> str | None:
    """This boot of the machine (Linux); None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _temp_owner(temp: str) -> str:
    """The cache name a temp file belongs to: ``.<name>.unbroken-tmp-fill``, or a
    download's own temp beside it, ``..<name>.unbroken-tmp-fill.unbroken-tmp-<pid>-<rand>``."""
    return temp.lstrip(".").split(TEMP_MARKER, 1)[0]


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


def close_inherited(layouts: Iterable[CacheLayout]) -> None:
    """In a forked child: close every descriptor of the layouts' lock, ledger, object
    and record files, found in one pass over /proc/self/fd (deleted files too): the
    parent's threads opened them, and a copy kept here would keep their locks and pins
    alive. Plans are left to the access plan (``access_plan.py``)."""
    dirs, files = set(), set()
    for layout in layouts:
        dirs.update(d + os.sep for d in layout.inherited_dirs)
        files.update(layout.inherited_files)
    if not dirs:
        return
    prefixes = tuple(dirs)
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: the ledger and records were closed by after_fork
        return
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry}").removesuffix(" (deleted)")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target in files or target.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.close(int(entry))  # the parent's copy keeps its lock; ours must not
