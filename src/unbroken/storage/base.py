"""The store contract every tier speaks: keys, atomic writes, ranged reads, listing.

Public methods validate the key, then call one small private hook inside the retry
loop, so a backend only says how to move bytes and never how to retry or name errors.
"""

from __future__ import annotations

import copy
import errno
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.retry import RetryPolicy, RetryStats, as_retry_policy, call_with_retry

Buffer = Any
"""A read-only bytes-like object (bytes, or a backend's own buffer): ``memoryview`` takes it."""

T = TypeVar("T")

TEMP_MARKER = ".unbroken-tmp-"
"""Part of every temporary name; listings never show such names."""


@dataclass(frozen=True, order=True)
class Entry:
    """One object under a store: its key relative to the store root, and its size."""

    key: str
    size: int
    etag: str | None = None
    """Changes whenever the content changes (an object ETag, or mtime_ns on a path)."""


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Keys are relative, '/'-separated, with no '.' or '..' parts and no temp marker.

    An absolute key ('/a/b') is refused rather than quietly made relative: the caller
    may have meant a path outside the store."""
    if not isinstance(key, str):
        raise TypeError(f"store key must be a str, got {type(key).__name__}")
    if key.startswith("/") and key.strip("/"):
        raise ValueError(f"invalid store key {key!r}: absolute; keys are relative to the store")
    stripped = key.strip("/")
    if not stripped:
        if allow_empty:
            return ""
        raise ValueError("store key is empty")
    parts = stripped.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in stripped:
        raise ValueError(f"invalid store key {key!r}: use relative 'a/b' keys without '..'")
    if TEMP_MARKER in stripped:
        raise ValueError(f"invalid store key {key!r}: {TEMP_MARKER!r} is reserved")
    return stripped


def temp_name(final_name: str) -> str:
    """A sibling temp name that is unique and tells which process made it."""
    return f".{final_name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_temp_name(name: str) -> bool:
    return TEMP_MARKER in name


def temp_owner_pid(name: str) -> int | None:
    """The pid of the process that made temp file ``name`` (None if it names none)."""
    try:
        return int(name.split(TEMP_MARKER, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return None


class Store(ABC):
    """Bytes under a root URL. Writes are atomic: readers see all of an object or none.

    Use :func:`unbroken.open_store` to make one.
    """

    def __init__(self, url: str, *, retry: RetryPolicy | None = None) -> None:
        self.url = url.rstrip("/")
        self.retry = as_retry_policy(retry)
        self.stats = RetryStats()

    def with_retry(self, retry: RetryPolicy) -> Store:
        """This store under another retry policy: for a caller that must not wait out the
        store's whole patience (a claim before the local write, a look at a commit record
        after a peer died)."""
        other = copy.copy(self)
        other.retry = retry
        return other

    def __repr__(self) -> str:
        from unbroken.storage.errors import redact

        return f"{type(self).__name__}({redact(self.url)!r})"

    # -- public surface -------------------------------------------------------------

    def url_for(self, key: str) -> str:
        key = check_key(key, allow_empty=True)
        return f"{self.url}/{key}" if key else self.url

    def write_bytes(
        self, key: str, data: bytes | bytearray | memoryview, *, create_only: bool = False
    ) -> None:
        """Store ``data`` under ``key`` atomically, replacing any old object.

        ``create_only``: never replace; if an object is already there (or another writer
        creates it first) raise :class:`ObjectExistsError` and leave it as it was. Atomic
        on local paths, S3, GCS, Azure and memory:// (see ``atomic_create``)."""
        key = check_key(key)
        if create_only:
            self._run("create", key, lambda: self._create_bytes(key, data))
        else:
            self._run("write_bytes", key, lambda: self._write_bytes(key, data))

    atomic_create: bool = True
    """Whether ``write_bytes(create_only=True)`` is one atomic step on this store. Where
    it is not (an fsspec filesystem without an exclusive create), it checks, then writes:
    two writers racing within that window can both succeed."""

    def read_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or the range [start, end) of them.

        A range that is reversed or reaches past the end of the object is a ValueError,
        never a short or empty answer that a caller could take for the data."""
        key = check_key(key)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError(f"read_bytes {key!r}: negative range [{start}, {end})")
        if start is not None and end is not None and start > end:
            raise ValueError(f"read_bytes {key!r}: reversed range [{start}, {end})")
        data = self._run("read_bytes", key, lambda: self._read_bytes(key, start, end))
        if end is not None and len(data) < end - (start or 0):
            self._past_end("read_bytes", key, f"range [{start or 0}, {end}) reaches")
        if end is None and start and not data and start > self.info(key).size:
            self._past_end("read_bytes", key, f"start {start} is")
        return data

    def read_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The whole object and the version (etag) those bytes are, from the same read,
        for a caller that must know the bytes are the version it listed (a cache naming
        its files by etag); None where this backend cannot tell from the read itself."""
        key = check_key(key)
        return self._run("read_bytes", key, lambda: self._read_versioned(key))

    def read_range(self, key: str, start: int, end: int) -> Buffer:
        """The bytes [start, end) of the object as a read-only bytes-like object, which a
        backend may hand over without copying (obstore's own buffer): for a caller that
        copies them into place anyway (a restore into tensors). The same checks as
        ``read_bytes``: a range past the end of the object is a ValueError."""
        key = check_key(key)
        if start < 0 or end < start:
            raise ValueError(f"read_range {key!r}: bad range [{start}, {end})")
        data = self._run("read_bytes", key, lambda: self._read_range(key, start, end))
        if memoryview(data).nbytes < end - start:
            self._past_end("read_range", key, f"range [{start}, {end}) reaches")
        return data

    def _past_end(self, op: str, key: str, what: str) -> NoReturn:
        """Raise the ValueError of a read past the end, with the object's real size: a
        short answer only says where the read stopped (nothing, for a start past the end)."""
        size = self.info(key).size
        where = self.url_for(key)
        raise ValueError(f"{op} {where}: {what} past the end of the object ({size} bytes)")

    def upload(
        self,
        local_path: str | os.PathLike,
        key: str,
        *,
        memory: FileInMemory | None = None,
        local_ready: Callable[[], None] | None = None,
    ) -> None:
        """Copy a local file to ``key`` atomically, streaming (never all in memory).

        ``memory``: the file's bytes, still in memory. A store that can send from memory
        (``sends_from_memory``) takes them for its first attempt instead of reading the
        file back. They are given back as soon as the store has read them, or when that
        first attempt ends (a store down for a while must not hold them through its
        retries: they belong to the next save); retries read the file.

        ``local_ready``: the local file is still being written (from the same memory);
        calling it blocks until the file is whole and raises if its write failed. A store
        that ``uploads_before_file`` sends its first attempt from ``memory`` meanwhile and
        looks at the file only for a retry; any other store waits for the file first.
        """
        key = check_key(key)
        local_path = os.fspath(local_path)
        early = local_ready is not None and memory is not None and self.uploads_before_file
        if local_ready is not None and not early:
            local_ready()
        try:
            if not early:
                self._check_upload_source(local_path, key, memory)
            attempts = [0]

            def attempt() -> None:
                attempts[0] += 1
                if early and attempts[0] > 1:
                    assert local_ready is not None
                    local_ready()  # a retry reads the file
                    self._check_upload_source(local_path, key, None)
                try:
                    self._upload(local_path, key, memory)
                finally:
                    if memory is not None:
                        memory.give_back()  # lent to the first attempt only

            self._run("upload", key, attempt)
        finally:
            if memory is not None:
                memory.give_back()

    def _check_upload_source(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        if not os.path.isfile(local_path):
            raise FileNotFoundError(f"upload to {self.url_for(key)}: no local file {local_path}")
        if memory is not None:
            size = os.path.getsize(local_path)
            if memory.size != size:
                raise ValueError(
                    f"upload of {local_path} to {self.url_for(key)}: its copy in memory "
                    f"holds {memory.size} bytes, the file {size}"
                )
            if not self.sends_from_memory:
                memory.give_back()

    def download(self, key: str, local_path: str | os.PathLike, *, sync: bool = True) -> None:
        """Copy ``key`` to a local file; the local file appears whole or not at all.

        ``sync=False`` skips the fsyncs: for a copy that can be fetched again (a cache).
        """
        key = check_key(key)
        local_path = os.fspath(local_path)

        def write() -> None:
            atomic_local_write(local_path, self._download, key, sync=sync)

        self._run("download", key, write)

    def exists(self, key: str) -> bool:
        key = check_key(key)
        return self._run("exists", key, lambda: self._exists(key))

    def info(self, key: str) -> Entry:
        """Size and etag of one object; raises ObjectNotFoundError if it is absent."""
        key = check_key(key)
        return self._run("info", key, lambda: self._info(key))

    def list(
        self,
        prefix: str = "",
        *,
        include_temp: bool = False,
        progress: Callable[[int], None] | None = None,
        unlisted: list[tuple[str, str]] | None = None,
        after: str | None = None,
    ) -> list[Entry]:
        """Every object under ``prefix``, recursively, sorted by key; temp files hidden
        unless ``include_temp`` (housekeeping: a crashed writer's are its only trace).
        ``after``: only the keys that sort after it, the others not even listed where the
        backend can start there (an object store's start-after, a folder's entries).
        ``progress(n)`` hears of each page of ``n`` entries as it arrives (a listing of
        millions of objects takes minutes), where the backend lists in pages.

        On a local path, a store holds the regular files its root reaches without
        following links: a link or a pipe is no object of it, and a folder it may not read
        raises. ``unlisted``: given, such a folder and a link out of the root are noted
        there, as (key, why), and the listing goes on; a dataset decides what they mean."""
        prefix = check_key(prefix, allow_empty=True)

        def collect() -> list[Entry]:
            entries: list[Entry] = []
            if unlisted is not None:
                unlisted.clear()  # (a retry lists again)
            for page in self._list_pages(prefix, unlisted, after):
                entries.extend(page)
                if progress is not None:
                    progress(len(page))
            return entries

        entries = self._run("list", prefix, collect)
        return sorted(
            e
            for e in entries
            if (include_temp or not is_temp_name(e.key)) and (after is None or e.key > after)
        )

    def delete(self, key: str) -> None:
        """Remove one object, or everything under a prefix. Absent keys are fine."""
        key = check_key(key)
        self._run("delete", key, lambda: self._delete(key))

    # -- hooks a backend implements ------------------------------------------------

    @abstractmethod
    def _write_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def _create_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` only if nothing is at ``key``; raise FileExistsError if it is.
        Every backend has one: a commit record must never be overwritten."""

    @abstractmethod
    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        """The bytes in [start, end), clamped to the object (b'' past its end): the
        public method tells a short answer from the data and raises."""

    def _read_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The whole object and its etag as of that read; None if the read cannot say."""
        return self._read_bytes(key, None, None), None

    def _read_range(self, key: str, start: int, end: int) -> Buffer:
        """[start, end), clamped to the object; a backend with a buffer of its own may
        return that instead of copying it into bytes."""
        return self._read_bytes(key, start, end)

    sends_from_memory: bool = False
    """Whether ``upload`` can send a file's bytes from memory (see :meth:`upload`)."""
    uploads_before_file: bool = False
    """Whether ``upload`` with ``memory`` sends its first attempt before the local file is
    whole (``local_ready``): that attempt reads the memory only, never the file."""

    @abstractmethod
    def _upload(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        """Upload the file, or ``memory.take()``'s parts when that gives any (then
        ``memory.give_back()`` once they are read). Called again on a retry."""

    def _upload_staged(
        self, local_path: str, key: str, memory: FileInMemory | None
    ) -> Callable[[bool], None]:
        """An upload in two steps: do what can be done ahead, return ``finish`` that
        publishes (True) or abandons (False) it. Nothing is visible before ``finish(True)``.

        This default does everything in ``finish``; a store that can stage the bytes
        under a hidden name (LocalStore) overrides it."""

        def finish(publish: bool) -> None:
            if publish:
                self._upload(local_path, key, memory)

        return finish

    @abstractmethod
    def _download(self, key: str, local_path: str) -> None:
        """Write the object to ``local_path`` (a temp name; the caller renames it)."""

    @abstractmethod
    def _info(self, key: str) -> Entry: ...

    def _exists(self, key: str) -> bool:
        try:
            self._info(key)
            return True
        except (FileNotFoundError, IsADirectoryError):  # a prefix is not an object
            return False

    @abstractmethod
    def _list(self, prefix: str) -> list[Entry]: ...

    def _list_pages(
        self, prefix: str, unlisted: list[tuple[str, str]] | None = None, after: str | None = None
    ) -> Iterator[list[Entry]]:
        """The listing in pages as they arrive; one page where the backend has no pages.
        ``unlisted``: see :meth:`list` (only a backend of local paths has any); ``after``:
        a backend may leave out keys up to it (:meth:`list` drops any it listed)."""
        yield self._list(prefix)

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    # -- plumbing -------------------------------------------------------------------

    def _run(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return call_with_retry(
            fn, op=op, url=self.url_for(key), policy=self.retry, stats=self.stats
        )


def fsync_dir(path: str) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_local_write(
    final_path: str,
    fill: Callable[[str, str], None],
    key: str,
    *,
    sync: bool = True,
    create_only: bool = False,
) -> None:
    """Run ``fill(key, tmp)`` into a sibling temp file, fsync it, rename into place.

    ``sync=False`` skips both fsyncs: still atomic for readers, but not durable across a
    power loss; for copies that are checksummed and can be fetched again.
    ``create_only``: hard-link the temp file to the final name instead of renaming, which
    fails (FileExistsError) if the name is taken, so of two writers exactly one wins."""
    staged_local_write(final_path, fill, key, sync=sync, create_only=create_only)(True)


def staged_local_write(
    final_path: str,
    fill: Callable[[str, str], None],
    key: str,
    *,
    sync: bool = True,
    create_only: bool = False,
) -> Callable[[bool], None]:
    """The first half of :func:`atomic_local_write`: ``fill`` a sibling temp file.

    Returns ``finish``: ``finish(True)`` renames the file into place (fsyncing the
    directory when ``sync``), ``finish(False)`` deletes it. Until then nothing is visible
    at ``final_path``; a crashed writer leaves a temp name that ``sweep_temp`` removes."""
    directory = os.path.dirname(os.path.abspath(final_path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, temp_name(os.path.basename(final_path)))

    def drop() -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass

    try:
        fill(key, tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
    except BaseException:
        drop()
        raise

    def finish(publish: bool) -> None:
        if not publish:
            drop()
            return
        try:
            if create_only:
                _link_exclusive(tmp, final_path)
                drop()
            else:
                os.replace(tmp, final_path)
        except BaseException:
            drop()
            raise
        if sync:
            fsync_dir(directory)

    return finish


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}


def _link_exclusive(tmp: str, final_path: str) -> None:
    """Publish the whole file ``tmp`` at ``final_path`` unless something is there.

    A hard link is atomic and exclusive: readers see all of the file or nothing, and a
    second writer gets FileExistsError. A filesystem without hard links (some network
    and FUSE mounts) falls back to O_EXCL: still exclusive, but a reader may see the
    file while it is being copied in."""
    try:
        os.link(tmp, final_path)
        return
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
            raise
    fd = os.open(final_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as dst, open(tmp, "rb") as src:
        shutil.copyfileobj(src, dst)
        dst.flush()
        os.fsync(dst.fileno())
