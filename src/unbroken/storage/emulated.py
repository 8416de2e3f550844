"""An emulated remote: wraps any store with latency, a node-wide link and faults.

Benchmarks and fault tests use it to stand in for a far object store or a slow
network mount. ``RemoteProfile()`` with no arguments is the project's standard
remote profile (bench/README.md): 20 ms per request, a 200 MB/s link shared by
every process on the node.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from unbroken._util.sizes import parse_size
from unbroken._util.thread_names import name_native_thread
from unbroken.storage.base import Entry, Store
from unbroken.storage.errors import TransientStoreError
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.link import SharedLink, sleep_until
from unbroken.storage.retry import RetryPolicy

EMULATED_PREFIX = "emulated::"


@dataclass(frozen=True)
class RemoteProfile:
    """How the emulated remote behaves. Every field is also a ``storage_options`` key."""

    latency: float = 0.020
    """Seconds added to every request (first byte), not shared between requests."""
    bandwidth: float | None = 200e6
    """Bytes/second of the link, shared by all processes on the node; None = unlimited."""
    link: str = "default"
    """Name of the shared link; processes using the same name share its bandwidth."""
    fail_rate: float = 0.0
    """Fraction of requests that fail with a transient error (a dropped connection)."""
    cut_rate: float = 0.0
    """Fraction of writes cut off halfway: half the bytes travel, then the write fails."""
    outage_at: float | None = None
    """Wall-clock time (``time.time()``) from which every request fails: a full outage."""
    outage_file: str | None = None
    """While a file exists at this local path, every request fails (an outage switch)."""
    seed: int | None = None
    """Seed for the fault draws; None draws a fresh one per process."""

    def __post_init__(self) -> None:
        if self.latency < 0:
            raise ValueError(f"emulated remote: latency must be >= 0, got {self.latency}")
        for name in ("fail_rate", "cut_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"emulated remote: {name} must be in [0, 1], got {value}")

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> RemoteProfile:
        """Take this profile's keys out of ``options``; the rest belong to the inner store."""
        known = {f.name for f in fields(cls)}
        mine = {k: options.pop(k) for k in list(options) if k in known}
        if "bandwidth" in mine and mine["bandwidth"] is not None:
            mine["bandwidth"] = float(parse_size(mine["bandwidth"]))
        return cls(**mine)

    def describe(self) -> str:
        bw = "unlimited" if self.bandwidth is None else f"{self.bandwidth / 1e6:g} MB/s"
        return f"{self.latency * 1000:g} ms per request, {bw} link shared node-wide"

    def as_options(self) -> dict[str, Any]:
        return asdict(self)


class EmulatedStore(Store):
    """``inner`` seen through a slow, shared, optionally faulty network."""

    def __init__(
        self,
        inner: Store,
        profile: RemoteProfile | None = None,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(EMULATED_PREFIX + inner.url, retry=retry)
        self.inner = inner
        self.profile = profile or RemoteProfile()
        self.link = (
            SharedLink(self.profile.bandwidth, self.profile.link)
            if self.profile.bandwidth
            else None
        )
        self._rng = random.Random(self.profile.seed)
        self.faults_injected = 0

    # -- the network ------------------------------------------------------------------

    def _request(self, op: str, key: str) -> float:
        """One round trip: the outage and random-failure checks, then the latency.

        Returns the monotonic time the first byte can move. A refused request waits
        out its latency before failing; an accepted one pays it together with its
        payload in :meth:`_move`, one sleep per request.
        """
        ready = time.monotonic() + self.profile.latency
        p = self.profile
        if (p.outage_at is not None and time.time() + p.latency >= p.outage_at) or (
            p.outage_file and os.path.exists(p.outage_file)
        ):
            self.faults_injected += 1
            sleep_until(ready)
            raise TransientStoreError(f"emulated outage: {op} {key} refused (remote down)")
        if p.fail_rate and self._rng.random() < p.fail_rate:
            self.faults_injected += 1
            sleep_until(ready)
            raise TransientStoreError(f"emulated fault: connection reset during {op} {key}")
        return ready

    def _move(self, nbytes: int, ready: float) -> None:
        """Move ``nbytes`` over the link, starting at ``ready``; returns when all landed."""
        if self.link is not None and nbytes:
            self.link.transfer(nbytes, not_before=ready)
        else:
            sleep_until(ready)

    def _send(self, op: str, key: str, nbytes: int) -> float:
        """Request plus payload upstream: a payload cut off halfway lands nothing.

        Returns the monotonic time its first byte may move; the caller moves it."""
        ready = self._request(op, key)
        if self.profile.cut_rate and self._rng.random() < self.profile.cut_rate:
            self._move(nbytes // 2, ready)
            self.faults_injected += 1
            raise TransientStoreError(
                f"emulated fault: {op} {key} cut off after {nbytes // 2} of {nbytes} bytes"
            )
        return ready

    # -- hooks --------------------------------------------------------------------------

    def _write_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        self._move(nbytes, self._send("write_bytes", key, nbytes))
        self.inner._write_bytes(key, data)

    def _create_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        self._move(nbytes, self._send("create", key, nbytes))
        self.inner._create_bytes(key, data)

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        return self.inner.atomic_create

    @property
    def sends_from_memory(self) -> bool:  # type: ignore[override]
        return self.inner.sends_from_memory

    def _upload(self, local_path: str, key: str, memory: FileInMemory | None) -> None:
        """The file crosses the link while the inner store copies it; done when both are.

        A real client reads the file part by part as it sends, and the remote's own disk
        write is not the client's time, so the copy runs beside the transfer instead of
        after it (reading a large file from local disk would otherwise add its whole read
        time to every upload). The copy (from ``memory`` when the inner store takes it)
        lands under a temp name and is published only once the transfer has finished: a
        transfer that fails, or a process killed during it, leaves no object. Inner
        stores that cannot stage ahead copy afterwards.
        """
        nbytes = os.path.getsize(local_path)
        ready = self._send("upload", key, nbytes)
        stage = self.inner._upload_staged
        staged: list[Callable[[bool], None]] = []
        failure: list[BaseException] = []

        def copy() -> None:
            name_native_thread()
            try:
                staged.append(stage(local_path, key, memory))
            except BaseException as e:  # re-raised in the caller's thread
                failure.append(e)

        writer = threading.Thread(target=copy, name="unbroken-emulated-write", daemon=True)
        writer.start()
        try:
            self._move(nbytes, ready)
        except BaseException:
            writer.join()
            for finish in staged:
                finish(False)
            raise
        writer.join()
        if failure:
            raise failure[0]
        staged[0](True)

    def _read_bytes(self, key: str, start: int | None, end: int | None) -> bytes:
        ready = self._request("read_bytes", key)
        data = self.inner._read_bytes(key, start, end)
        self._move(len(data), ready)
        return data

    def _read_versioned(self, key: str) -> tuple[bytes, str | None]:
        ready = self._request("read_bytes", key)
        data, etag = self.inner._read_versioned(key)
        self._move(len(data), ready)
        return data, etag

    def _download(self, key: str, local_path: str) -> None:
        ready = self._request("download", key)
        self.inner._download(key, local_path)
        self._move(os.path.getsize(local_path), ready)

    def _info(self, key: str) -> Entry:
        sleep_until(self._request("info", key))
        return self.inner._info(key)

    def _exists(self, key: str) -> bool:
        sleep_until(self._request("exists", key))
        return self.inner._exists(key)

    def _list(self, prefix: str) -> list[Entry]:
        sleep_until(self._request("list", prefix))
        return self.inner._list(prefix)

    def _list_pages(
        self, prefix: str, unlisted: list[tuple[str, str]] | None = None, after: str | None = None
    ) -> Iterator[list[Entry]]:
        sleep_until(self._request("list", prefix))
        yield from self.inner._list_pages(prefix, unlisted, after)

    def _delete(self, key: str) -> None:
        sleep_until(self._request("delete", key))
        self.inner._delete(key)
