"""A store over any fsspec filesystem: object stores (s3://, gs://, ...) and memory://.

Object stores have no rename: a single PUT (or a completed multipart upload) is the
atomic step, and an unfinished multipart upload is never visible as an object.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from unbroken.storage.base import Entry, Store
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.retry import RetryPolicy

RANGED_PART = 8 << 20
"""Objects larger than this move as parallel parts (ranged GETs, multipart PUTs) of this size."""
RANGED_STREAMS = 8
"""Parallel streams for one large download or multipart upload (memory: streams x part)."""


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
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self._object_store = not _has_real_dirs(self.fs)

    def path_for(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _write_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.fs.pipe_file(self.path_for(key), bytes(data))
        self._forget(key)

    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        if end is not None and start is not None and end <= start:
            self._info(key)  # still raise for a missing key
            return b""
        return self.fs.cat_file(self.path_for(key), start=start, end=end)

    def _upload(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        # Not from memory (sends_from_memory is False): s3fs's multipart reads the file.
        if self._object_store and "s3" in _protocols(self.fs):
            # Bounded multipart: at most streams x part bytes of the file in memory.
            self.fs.put_file(
                local_path,
                self.path_for(key),
                chunksize=max(RANGED_PART, 5 << 20),  # S3's minimum part is 5 MiB
                max_concurrency=RANGED_STREAMS,
            )
        else:
            self.fs.put_file(local_path, self.path_for(key))
        self._forget(key)

    def _download(self, key: str, local_path: str) -> None:
        size = self._info(key).size
        if size <= RANGED_PART:
            self.fs.get_file(self.path_for(key), local_path)
            return
        path = self.path_for(key)
        with open(local_path, "wb") as f:
            f.truncate(size)
            fd = f.fileno()

            def fetch(offset: int) -> None:
                data = self.fs.cat_file(path, start=offset, end=min(size, offset + RANGED_PART))
                os.pwrite(fd, data, offset)

            with ThreadPoolExecutor(RANGED_STREAMS) as pool:
                list(pool.map(fetch, range(0, size, RANGED_PART)))

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
        root_prefix = self.root + "/"
        entries = []
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            key = path[len(root_prefix) :] if path.startswith(root_prefix) else path.lstrip("/")
            entries.append(Entry(key, int(info["size"]), _etag(info)))
        return entries

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
