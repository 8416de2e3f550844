"""A store on a local disk or a network mount: temp name + fsync + rename + dir fsync."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator

from unbroken._util.direct_io import copy_file_uncached, write_parts
from unbroken._util.fileio import pread_exactly
from unbroken._util.procs import pid_alive
from unbroken.storage.base import (
    Entry,
    Store,
    atomic_local_write,
    is_temp_name,
    staged_local_write,
    temp_owner_pid,
)
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.retry import RetryPolicy

UNREADABLE = "cannot be read"
"""How ``Store.list(unlisted=)`` begins the reason of a folder it may not read."""


class LocalStore(Store):
    """Objects are files under ``root``; a key's '/' parts are directories."""

    def __init__(
        self, root: str, *, retry: RetryPolicy | None = None, uncached_uploads: bool = False
    ) -> None:
        """``uncached_uploads``: uploads are written with O_DIRECT, bypassing the page
        cache (for a directory that stands in for another machine's storage)."""
        self.root = os.path.abspath(os.path.expanduser(root))
        self.uncached_uploads = uncached_uploads
        super().__init__(self.root, retry=retry)

    def path_for(self, key: str) -> str:
        """The file of ``key``, refused if any part of it under the root is a symbolic
        link: a key never reaches outside the root (nor a file a link points at)."""
        if not key:
            return self.root
        path = self.root
        for part in key.split("/"):
            path = os.path.join(path, part)
            if os.path.islink(path):
                raise PermissionError(
                    errno.EPERM,
                    f"{path} is a symbolic link; the store at {self.root} never follows "
                    f"links, so key {key!r} is refused",
                )
        return path

    def _write_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        atomic_local_write(self.path_for(key), _fill_with(data), key)

    def _create_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        atomic_local_write(self.path_for(key), _fill_with(data), key, create_only=True)

    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        return self._read_with_stat(key, start, end, recheck=False)[0]

    def _read_versioned(self, key: str) -> tuple[bytes, str | None]:
        data, st = self._read_with_stat(key, None, None, recheck=True)
        return data, _version(st)

    def _read_with_stat(
        self, key: str, start: int | None, end: int | None, *, recheck: bool
    ) -> tuple[bytes, os.stat_result]:
        """The bytes and the file's stat from the same open file. ``recheck``: stat it
        again after the read; a file rewritten in place meanwhile shows another mtime,
        and that stat is given (the cache then sees another version than it listed)."""
        fd = os.open(self.path_for(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", self.path_for(key))
            start = start or 0
            stop = st.st_size if end is None else min(end, st.st_size)
            data = pread_exactly(fd, max(0, stop - start), start)
            return data, os.fstat(fd) if recheck else st
        finally:
            os.close(fd)

    sends_from_memory = True

    def _upload(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        self._upload_staged(local_path, key, memory)(True)

    def _upload_staged(
        self, local_path: str, key: str, memory: FileInMemory | None
    ) -> Callable[[bool], None]:
        """Copy the file (or its bytes from memory) under a temp name; the returned
        function publishes it (True) or drops it (False). Lets the emulated remote copy
        while its link moves the bytes."""
        parts = memory.take() if memory is not None else None
        if parts is not None:

            def fill(_key: str, tmp: str) -> None:
                read_all = False
                try:
                    write_parts(parts, tmp, direct=self.uncached_uploads)
                    read_all = True
                finally:
                    memory.give_back(read_all=read_all)

        else:
            copy = copy_file_uncached if self.uncached_uploads else copy_file

            def fill(_key: str, tmp: str) -> None:
                copy(local_path, tmp)

        return staged_local_write(self.path_for(key), fill, key)

    def _download(self, key: str, local_path: str) -> None:
        copy_file(self.path_for(key), local_path)

    def _info(self, key: str) -> Entry:
        path = self.path_for(key)
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is a directory, not an object")
        return Entry(key, st.st_size, _version(st))

    def _list(self, prefix: str) -> list[Entry]:
        return self._walk(prefix, None)

    def _list_pages(
        self, prefix: str, unlisted: list[tuple[str, str]] | None = None, after: str | None = None
    ) -> Iterator[list[Entry]]:
        yield self._walk(prefix, unlisted, after)

    def _walk(
        self, prefix: str, unlisted: list[tuple[str, str]] | None, after: str | None = None
    ) -> list[Entry]:
        """The regular files under ``prefix``, reached without following links; see
        ``Store.list`` for ``unlisted``. A folder that cannot be read raises otherwise:
        skipped, it would leave a restore without its checkpoints. ``lost+found`` at the
        root is fsck's, never the store's. ``after``: keys up to it are left out, and a
        folder whose every key sorts before it is not entered."""
        top = self.path_for(prefix)
        if os.path.isfile(top):
            return [self._info(prefix)]
        lost_found = os.path.join(self.root, "lost+found")
        entries = []
        folders = [(top, f"{prefix}/" if prefix else "")]  # (path, the keys' start in it)
        while folders:
            folder, within = folders.pop()
            try:
                listing = os.scandir(folder)
            except FileNotFoundError:  # nothing there yet, or removed while we walked
                continue
            except NotADirectoryError:
                if folder == top:  # a prefix that names no folder lists nothing
                    continue
                raise
            except PermissionError as exc:
                if unlisted is None or folder == top:  # nothing at all could be listed
                    raise
                unlisted.append((within, f"{UNREADABLE} ({exc.strerror})"))
                continue
            with listing:
                for item in listing:  # temp files too: Store.list hides them unless asked
                    key = within + item.name
                    if item.is_dir(follow_symlinks=False):
                        if item.path != lost_found and not _all_before(key + "/", after):
                            folders.append((item.path, key + "/"))
                        continue
                    if after is not None and key <= after:
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted while we walked
                        continue
                    if stat.S_ISREG(st.st_mode):
                        entries.append(Entry(key, st.st_size, _version(st)))
                    elif unlisted is not None and (out := self._link_out(item.path, st)):
                        slash = "/" if os.path.isdir(item.path) else ""  # a folder: files in it
                        unlisted.append((key + slash, out))
        return entries

    def _link_out(self, path: str, st: os.stat_result) -> str | None:
        """Why ``path`` is left out, if it is a symbolic link out of the root (one inside
        it, even a dangling ``latest``, is an alias of what is listed by its own name)."""
        if not stat.S_ISLNK(st.st_mode):
            return None
        root = os.path.realpath(self.root)
        if os.path.commonpath([os.path.realpath(path), root]) == root:
            return None
        return f"a symbolic link to {os.readlink(path)}, outside {self.root} (never followed)"

    def _delete(self, key: str) -> None:
        path = self.path_for(key)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=False)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def sweep_temp(self, prefix: str = "", *, min_age: float = 0.0) -> int:
        """Remove temp files left by crashed writers (dead pid, or older than min_age)."""
        removed = 0
        now = time.time()
        for dirpath, _dirs, files in os.walk(self.path_for(prefix)):
            for name in files:
                if not is_temp_name(name):
                    continue
                path = os.path.join(dirpath, name)
                pid = temp_owner_pid(name)
                try:
                    old = now - os.stat(path).st_mtime >= min_age
                    if (pid is not None and not pid_alive(pid)) or (min_age and old):
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed


def _fill_with(data: bytes | bytearray | memoryview) -> Callable[[str, str], None]:
    def fill(_key: str, tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return fill


def copy_file(src: str, dst: str) -> None:
    """Stream ``src`` into ``dst`` (kernel copy where the OS offers one)."""
    shutil.copyfile(src, dst)


def _version(st: os.stat_result) -> str:
    """A local file's etag: its mtime and size (a rewrite changes the mtime)."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


def _all_before(folder: str, after: str | None) -> bool:
    """Whether every key under ``folder`` (ending in "/") sorts before ``after``."""
    return after is not None and folder < after and not after.startswith(folder)
