"""A bench-only fsspec filesystem over an unbroken ``Store``.

It lets ``torch.save`` (through ``fsspec.open``) and DCP's ``FsspecWriter`` /
``FsspecReader`` go through the very same emulated link as the unbroken row, so every
row of bench/checkpoint/saves.py pays the same network. URLs look like ``ubstore://<key>``;
the store itself comes from the storage options ``store_url`` plus the emulated remote's
profile options (``latency``, ``bandwidth``, ``link``), so an instance rebuilds itself
in any process (DCP's checkpoint process unpickles it with those arguments).

Writes spill to a local temporary file and go up with one ``Store.upload`` on close, the
way s3fs buffers a multipart upload; reads fetch byte ranges with ``Store.read_bytes``.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from unbroken.storage import ObjectNotFoundError, Store, StoreError, open_store

PROTOCOL = "ubstore"
READ_BLOCK = 16 << 20
"""Bytes fetched per read request, kept in an LRU of blocks (fsspec's "blockcache").

DCP reads a shard file's items in state-dict order while it wrote them largest first,
and torch.load reads each item in small pieces: a readahead cache refetches (6.6 s to
restore 0.3 GiB here), exact ranges pay 20 ms per piece (47 s); cached 16 MiB blocks
took 3.3 s (the link floor is 1.6 s). The baselines get the fastest of these."""


class _StoreWriteFile(io.RawIOBase):
    """Buffers a whole object in a local spill file, uploads it on close."""

    def __init__(self, store: Store, key: str, spill_dir: str | None) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._spill = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close())
            prefix="ubstore-spill-", dir=spill_dir, delete=False
        )
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._spill.write(data)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        """The spill file's descriptor: lets DCP fsync it instead of calling os.sync()."""
        return self._spill.fileno()

    def flush(self) -> None:
        if not self._spill.closed:
            self._spill.flush()

    def close(self) -> None:
        self._finish(upload=True)

    def discard(self) -> None:
        """Drop the spill without uploading (a failed write)."""
        self._finish(upload=False)

    def _finish(self, *, upload: bool) -> None:
        if self.closed:
            return
        path = self._spill.name
        try:
            self._spill.close()
            if upload:
                self._store.upload(path, self._key)
        finally:
            os.unlink(path)
            super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """A write that raised uploads nothing: a half object must never appear."""
        if exc_type is None:
            self.close()
        else:
            self.discard()


class _StoreReadFile(AbstractBufferedFile):
    """Ranged reads of one object, in cached blocks of READ_BLOCK bytes."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        # fsspec asks for whole blocks; a Store refuses a range past the object's end.
        end = min(end, self.size)
        return self.fs.store.read_bytes(self.fs.key(self.path), min(start, end), end)


class StoreFileSystem(AbstractFileSystem):
    """``ubstore://<key>`` -> ``store_url``'s object ``<key>``."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, store_url: str, spill_dir: str | None = None, **options: Any) -> None:
        super().__init__(store_url=store_url, spill_dir=spill_dir, **options)
        self.store = open_store(store_url, **options)
        self.spill_dir = spill_dir

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = os.fspath(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3 :]
        return path.strip("/")

    def key(self, path: str) -> str:
        return self._strip_protocol(path)

    # -- reads and metadata -------------------------------------------------------------

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        key = self.key(path)
        if not key:
            return {"name": "", "size": 0, "type": "directory"}
        try:
            entry = self.store.info(key)
            return {"name": key, "size": entry.size, "type": "file"}
        except (ObjectNotFoundError, FileNotFoundError, StoreError):
            pass  # absent, or a "directory" (LocalStore.info raises a plain StoreError)
        if self.store.list(key):
            return {"name": key, "size": 0, "type": "directory"}
        raise FileNotFoundError(f"{PROTOCOL}://{key}: no such object in {self.store.url}")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        key = self.key(path)
        depth = key.count("/") + 1 if key else 0
        seen: dict[str, dict[str, Any]] = {}
        for e in self.store.list(key):
            parts = e.key.split("/")
            name = "/".join(parts[: depth + 1])
            is_file = len(parts) == depth + 1
            seen.setdefault(
                name,
                {
                    "name": name,
                    "size": e.size if is_file else 0,
                    "type": "file" if is_file else "directory",
                },
            )
        out = [seen[n] for n in sorted(seen)]
        return out if detail else [d["name"] for d in out]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        return self.store.read_bytes(self.key(path), start, end)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> Any:
        key = self.key(path)
        if mode in ("wb", "xb"):
            return _StoreWriteFile(self.store, key, self.spill_dir)
        if mode != "rb":
            raise NotImplementedError(f"{PROTOCOL}: mode {mode!r} is not supported for {key}")
        return _StoreReadFile(
            self,
            key,
            mode,
            block_size=block_size or READ_BLOCK,
            cache_type="blockcache",
            cache_options=cache_options,
        )

    # -- writes ---------------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.store.write_bytes(self.key(path), value)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Object keys need no directories."""

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Object keys need no directories."""

    def _rm(self, path: str) -> None:
        self.store.delete(self.key(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            self.store.delete(self.key(p))

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth=None, **kw) -> None:
        """No rename on an object store: copy (the bytes travel twice), then delete."""
        src, dst = self.key(path1), self.key(path2)
        self.store.write_bytes(dst, self.store.read_bytes(src))
        self.store.delete(src)


def register() -> None:
    """Make ``ubstore://`` known to fsspec in this process."""
    fsspec.register_implementation(PROTOCOL, StoreFileSystem, clobber=True)


register()
