"""A peer's memory tier as a read-only Store, for restore (``recovery.py``).

A restore reads each file from the nearest tier that holds it whole; a peer's memory
comes after the node's own tiers and before the durable tier. A peer that dies or stops
answering in the middle of a restore is given up at once and for good (no retries: the
durable tier holds every byte), and what was still to be read from it comes from the
durable tier instead, the same keys: the restore goes on, from there.
"""

from __future__ import annotations

import logging
import threading

from unbroken.checkpoint.format.manifest import MANIFEST_NAME, Manifest, parse_step_dir, step_dir
from unbroken.checkpoint.peers.client import PeerClient, PeerError
from unbroken.storage.base import Entry, Store
from unbroken.storage.retry import NO_RETRY

log = logging.getLogger(__name__)


class PeerStore(Store):
    """Read-only view of one peer server; ``fallback`` (the durable tier) takes over the
    reads of a peer that is gone."""

    def __init__(self, client: PeerClient, fallback: Store) -> None:
        super().__init__(client.url, retry=NO_RETRY)
        self.client = client
        self.fallback = fallback
        self.gone: str | None = None
        """Why the peer was given up (its reads went to ``fallback`` from then on)."""
        self._lock = threading.Lock()

    def held(self, step: int, manifest: Manifest) -> frozenset[str]:
        """The files of ``manifest`` this peer holds at their listed size, in a copy whose
        manifest equals it (bytes are checked against their crc32c as they are read)."""
        try:
            copies = self.client.have(step)
        except (ConnectionError, PeerError) as e:
            self._give_up(e)
            return frozenset()
        names: set[str] = set()
        for copy in copies:
            try:
                theirs = Manifest.from_json(str(copy["manifest"]).encode(), where=self.url)
            except Exception:
                continue
            if theirs != manifest:
                continue
            for name, size in dict(copy["files"]).items():
                rec = manifest.files.get(name)
                if rec is not None and rec.size == size and name != MANIFEST_NAME:
                    names.add(name)
        return frozenset(names)

    def read_range_into(self, key: str, start: int, end: int, out: memoryview) -> int:
        """Bytes [start, end) straight into ``out`` (a restore's target tensor), from the
        peer or, once it is given up, from the durable tier; how many came."""
        if self.gone is None:
            step, name = _split(key)
            try:
                return self.client.read_into(step, name, start, end, out)
            except PeerError as e:
                if not e.missing:
                    raise
                self._give_up(e)
            except ConnectionError as e:
                self._give_up(e)
        data = memoryview(self.fallback.read_range(key, start, end)).cast("B")
        out[: data.nbytes] = data
        return data.nbytes

    # -- Store hooks -----------------------------------------------------------------

    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        return bytes(self._read(key, start or 0, end))

    def _read_range(self, key: str, start: int, end: int) -> bytearray:
        return self._read(key, start, end)

    def _read(self, key: str, start: int, end: int | None) -> bytearray:
        if self.gone is None:
            step, name = _split(key)
            try:
                return self.client.read(step, name, start, end)
            except PeerError as e:
                if e.missing:  # it held the file when asked: it dropped it since
                    self._give_up(e)
                else:
                    raise
            except ConnectionError as e:
                self._give_up(e)
        return bytearray(self.fallback.read_range(key, start, end) if end is not None
                         else self.fallback.read_bytes(key, start))  # fmt: skip

    def _give_up(self, why: BaseException) -> None:
        with self._lock:
            if self.gone is not None:
                return
            self.gone = str(why)
        log.warning(
            "peer %s is given up (%s): what was to come from it comes from %s",
            self.url,
            why,
            self.fallback.url,
        )

    def _refuse(self, *_: object) -> None:
        raise PermissionError(f"{self.url} is a peer's memory tier: read-only")

    _write_bytes = _create_bytes = _upload = _download = _delete = _refuse  # type: ignore[assignment]

    def _info(self, key: str) -> Entry:
        step, _ = _split(key)
        for entry in self._list(step_dir(step)):
            if entry.key == key:
                return entry
        raise FileNotFoundError(f"{self.url_for(key)}: the peer holds no such file")

    def _list(self, prefix: str) -> list[Entry]:
        """The files the peer holds of one step (``prefix``: ``step-N`` or below it);
        a peer is asked by step, never for all it holds."""
        folder = prefix.strip("/").split("/", 1)[0]
        step = parse_step_dir(folder)
        if step is None:
            raise ValueError(f"{self.url}: list one step's files (step-N/...), not {prefix!r}")
        files: dict[str, int] = {}
        for copy in self.client.have(step):
            files.update({n: int(size) for n, size in dict(copy["files"]).items()})
        keys = {f"{folder}/{n}": size for n, size in files.items()}
        return [Entry(k, v) for k, v in sorted(keys.items()) if k.startswith(prefix.strip("/"))]


def _split(key: str) -> tuple[int, str]:
    folder, _, name = key.partition("/")
    step = parse_step_dir(folder)
    if step is None or not name:
        raise ValueError(f"{key!r} is not a file of a step directory")
    return step, name
