"""A store over any fsspec filesystem: object stores (s3://, gs://, ...) and memory://.

Object stores have no rename: a single PUT (or a completed multipart upload) is the
atomic step, and an unfinished multipart upload is never visible as an object.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any

import fsspec

from unbroken.storage.base import Entry, Store
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.parts import PART_SIZE, PART_STREAMS, download_in_parts
from unbroken.storage.retry import RetryPolicy

_ATOMIC_CREATE = ("memory", "s3", "s3a")
"""Filesystems whose ``pipe_file(mode="create")`` is one atomic step."""
_MEMORY_CREATE = threading.Lock()
_PRECONDITION = re.compile(r"pre-?condition", re.IGNORECASE)
"""How s3fs reports a create-only PUT that found the key taken (412)."""
_RANGE_NOT_SATISFIABLE = re.compile(r"range is not satisfiable|InvalidRange", re.IGNORECASE)


class FsspecStore(Store):
    """Objects under ``url`` on the fsspec filesystem that the URL names."""

    def __init__(
        self,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(url, retry=retry)
        self.options = dict(storage_options or {})
        """The storage options it was opened with (another process opens it from them)."""
        self.fs, root = fsspec.core.url_to_fs(url, **self.options)
        self.root = root.rstrip("/")
        self._object_store = not _has_real_dirs(self.fs)

    def path_for(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _write_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.fs.pipe_file(self.path_for(key), bytes(data))
        self._forget(key)

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        """fsspec's own ``pipe_file(mode="create")`` checks, then writes; memory:// and
        s3fs make it one step (``open("xb")`` under the GIL, ``If-None-Match: *``)."""
        return any(p in _ATOMIC_CREATE for p in _protocols(self.fs))

    def _create_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._forget(key)
        # memory:// lives in this process: one lock makes its check-and-create one step.
        lock = _MEMORY_CREATE if "memory" in _protocols(self.fs) else contextlib.nullcontext()
        try:
            with lock:
                self.fs.pipe_file(self.path_for(key), bytes(data), mode="create")
        except OSError as exc:
            if isinstance(exc, FileExistsError) or not _PRECONDITION.search(str(exc)):
                raise
            raise FileExistsError(f"{self.path_for(key)} already exists ({exc})") from exc
        finally:
            self._forget(key)

    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        if end is not None and start is not None and end <= start:
            self._info(key)  # still raise for a missing key
            return b""
        try:
            return self.fs.cat_file(self.path_for(key), start=start, end=end)
        except OSError as exc:
            if not start or not _RANGE_NOT_SATISFIABLE.search(str(exc)):
                raise
            self._info(key)  # the range starts past the end (or the key is missing)
            return b""

    def _upload(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        # Not from memory (sends_from_memory is False): s3fs's multipart reads the file.
        if self._object_store and "s3" in _protocols(self.fs):
            # Bounded multipart: at most streams x part bytes of the file in memory.
            self.fs.put_file(
                local_path,
                self.path_for(key),
                chunksize=PART_SIZE,
                max_concurrency=PART_STREAMS,
            )
        else:
            self.fs.put_file(local_path, self.path_for(key))
        self._forget(key)

    def _download(self, key: str, local_path: str) -> None:
        size = self._info(key).size
        path = self.path_for(key)
        if size <= PART_SIZE:
            self.fs.get_file(path, local_path)
            return
        download_in_parts(
            size, lambda start, end: self.fs.cat_file(path, start=start, end=end), local_path
        )

    def _info(self, key: str) -> Entry:
        self._forget(key)
        info = self.fs.info(self.path_for(key))
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{self.path_for(key)} is a prefix, not an object")
        return Entry(key, int(info["size"]), _etag(info))

    def _list(self, prefix: str) -> list[Entry]:
        top = self.path_for(prefix)
        self.fs.invalidate_cache(top)
        found = self.fs.find(top, detail=True, withdirs=False)
        if not found:
            self._check_listable(top)
        root_prefix = self.root + "/"
        entries = []
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            key = path[len(root_prefix) :] if path.startswith(root_prefix) else path.lstrip("/")
            entries.append(Entry(key, int(info["size"]), _etag(info)))
        return entries

    def _check_listable(self, top: str) -> None:
        """Raise what kept an empty listing empty, if it was not just absence: fsspec's
        generic ``find`` treats every error as an empty directory, so an unreachable
        server (http://) would read as a store with nothing in it."""
        try:
            self.fs.ls(top, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            pass

    def _delete(self, key: str) -> None:
        path = self.path_for(key)
        self.fs.invalidate_cache(path)
        targets = self.fs.find(path, withdirs=False)
        if targets:
            self.fs.rm(targets)
        if not self._object_store and self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self._forget(key)

    def _forget(self, key: str) -> None:
        self.fs.invalidate_cache(self.path_for(key))


def _etag(info: dict[str, Any]) -> str | None:
    for field in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "created"):
        value = info.get(field)
        if value is not None:
            if hasattr(value, "timestamp"):  # memory:// gives a datetime here, a float there
                value = value.timestamp()
            return str(value).strip('"')
    return None


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _has_real_dirs(fs: fsspec.AbstractFileSystem) -> bool:
    return not any(p in ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory") for p in _protocols(fs))
