"""TierReader: a pickle-free DCP StorageReader over any Store (local, memory, S3).

It reads ``metadata.json`` (never ``.metadata``), checked against the manifest's size and
crc32c. Then, for each shard file this rank needs, it fetches only the byte windows that
hold the requested payloads (nearby payloads merged into one ranged read, a few windows
in flight), checks each payload's crc32c (recorded in the verified ``metadata.json``)
before DCP sees a byte, and serves any sub-range DCP's planner asks for, which is how a
checkpoint saved on N ranks loads on M. A tensor payload that fills its target whole
goes straight into the target's memory: from a local directory (the staging tier) read
into it and checksummed there (:mod:`unbroken.checkpoint.format.direct_read`), from a
remote store as parallel ranged reads, each checksummed and copied into its place by the
thread that fetched it (the store's own buffer, no bytes copy; the parts' crc32c folded).
One reader can take some files from the staging tier and the rest from the durable one
(a node's staging tier holds only its own ranks' files).
Non-tensor values are loaded with ``torch.load(weights_only=True)`` and handed to the
planner re-serialized, so the planner's own unrestricted ``torch.load`` only ever sees
data we already proved safe.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.autograd.graph import increment_version
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from unbroken._util.crc32c_combine import crc32c_combine
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from unbroken.checkpoint.format import read_plan
from unbroken.checkpoint.format.dcp_json import ItemLocation, dtype_from_name, metadata_from_json
from unbroken.checkpoint.format.direct_read import DirectRead, direct_reads, read_into
from unbroken.checkpoint.format.manifest import METADATA_JSON, Manifest, crc32c_bytes, step_dir
from unbroken.checkpoint.format.read_plan import (
    IN_FLIGHT,
    PARTS_IN_FLIGHT,
    Window,
    plan_windows,
)
from unbroken.checkpoint.format.tensor_record import tensor_from_raw
from unbroken.checkpoint.format.values import UnsafeValueError, load_weights_only
from unbroken.storage import LocalStore, ObjectNotFoundError, Store
from unbroken.storage.parts import part_ranges


@runtime_checkable
class ReadsInto(Protocol):
    """A store that receives a byte range straight into memory it is given."""

    def read_range_into(self, key: str, start: int, end: int, out: memoryview) -> int: ...


class TierReader(StorageReader):
    """Serves DCP's read requests for checkpoint ``step`` from ``store``.

    ``manifest`` is the step's commit record: it says which files exist and their sizes
    and checksums. With ``verify`` (the default) every byte handed to DCP was checked.
    ``nearby`` names the files read from a nearer store instead (the node's memory or
    disk tier), each with its store: on several nodes each node holds only its own ranks'
    files, and a rank reads what its node has from there and the rest from ``store``.
    """

    def __init__(
        self,
        store: Store,
        step: int,
        manifest: Manifest,
        *,
        verify: bool = True,
        nearby: Mapping[str, Store] | None = None,
    ) -> None:
        super().__init__()
        if manifest.step != step:
            raise ValueError(f"manifest is for step {manifest.step}, not step {step}")
        self.store = store
        self.step = step
        self.manifest = manifest
        self.verify = verify
        self.nearby: dict[str, Store] = dict(nearby or {})
        """Files read from a nearer tier than ``store``, and the store of each."""
        self._whole: dict[str, bytes] = {}
        """Whole files read and checked (metadata, RNG states: small), by name."""
        self._metadata: Metadata | None = None
        """The metadata as decoded and checked once: a restore asks for it three times, and
        decoding it costs about 25 µs a tensor (a second per 40,000)."""
        self.files_read: set[str] = set()
        """The files this reader has opened, by name (``source`` says from which store)."""
        self.prefix = step_dir(step)
        self.storage_data: dict[Any, ItemLocation] = {}
        self.load_id = str(uuid.uuid4())
        self.failure: CheckpointError | None = None
        """The last CheckpointError this reader raised (DCP may wrap or flatten it)."""

    # -- StorageReader --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.checkpoint_id:
            raise ValueError(
                f"TierReader serves {self.checkpoint_id}, not {checkpoint_id}; "
                "make a new TierReader for another checkpoint"
            )
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        self.failure = None

    def read_metadata(self) -> Metadata:  # no **kwargs: there is no per-rank fallback
        if self._metadata is None:
            try:
                data = self.read_whole(METADATA_JSON)
                metadata = metadata_from_json(data, where=self._url(METADATA_JSON))
                self._check_locations(metadata.storage_data)
            except CheckpointError as exc:
                self.failure = exc  # DCP flattens read_metadata errors into a message
                raise
            self._metadata = metadata
        meta = self._metadata.storage_meta or StorageMeta()  # this load's id, on a copy
        return dataclasses.replace(
            self._metadata, storage_meta=dataclasses.replace(meta, load_id=self.load_id)
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._check_locations(metadata.storage_data)
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read_data(plan, planner)
        except CheckpointError as exc:
            self.failure = exc
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        by_location: dict[ItemLocation, list[ReadItem]] = {}
        for req in plan.items:
            loc = self.storage_data.get(req.storage_index)
            if loc is None:
                raise CheckpointMismatchError(
                    f"step {self.step}: {self.checkpoint_id} has no item {req.storage_index}"
                )
            by_location.setdefault(loc, []).append(req)
        direct = direct_reads(by_location, planner)

        def fetch_the_rest() -> None:
            for loc, payload in self._fetch([loc for loc in by_location if loc not in direct]):
                for req in by_location[loc]:
                    self._deliver(req, loc, payload, planner)

        if direct:  # the rest's windows travel while the direct reads do
            self._read_direct(direct, planner, meanwhile=fetch_the_rest)
        else:
            fetch_the_rest()

    @property
    def checkpoint_id(self) -> str:
        return self.store.url_for(self.prefix)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # made explicitly from a Store and a manifest, never guessed from a path

    # -- fetching and checking ------------------------------------------------------

    def source(self, name: str) -> Store:
        """The store file ``name`` is read from."""
        return self.nearby.get(name, self.store)

    def _url(self, name: str) -> str:
        return self.source(name).url_for(f"{self.prefix}/{name}")

    def _corrupt(self, name: str, why: str) -> CheckpointCorruptError:
        url = self._url(name)
        return CheckpointCorruptError(
            f"checkpoint step {self.step}: {name} ({url}): {why}",
            step=self.step,
            file=name,
            url=url,
        )

    def _read_range(self, name: str, start: int | None = None, end: int | None = None) -> Any:
        """File ``name`` whole (bytes), or [start, end) as a read-only buffer (the store's
        own where it has one)."""
        self.files_read.add(name)
        key = f"{self.prefix}/{name}"
        try:
            if start is not None and end is not None:
                return self.source(name).read_range(key, start, end)
            return self.source(name).read_bytes(key, start, end)
        except ObjectNotFoundError as exc:
            raise self._corrupt(name, "file is missing") from exc
        except ValueError as exc:  # the range reaches past the end: a truncated file
            raise self._corrupt(name, f"short file: {exc}") from exc

    def read_whole(self, name: str) -> bytes:
        """File ``name`` whole, checked against its manifest record (size, crc32c)."""
        record = self.manifest.files.get(name)
        if record is None:
            raise self._corrupt(name, "not listed in the manifest")
        data = self._whole.get(name)
        if data is None:
            data = self._read_range(name)
        if len(data) != record.size:
            raise self._corrupt(name, f"{len(data)} bytes, manifest says {record.size}")
        if self.verify and (crc := crc32c_bytes(data)) != record.crc32c:
            raise self._corrupt(name, f"crc32c {crc:#010x}, manifest says {record.crc32c:#010x}")
        self._whole[name] = data  # DCP reads metadata.json again on every load pass
        return data

    def _check_locations(self, storage_data: Any) -> None:
        if not isinstance(storage_data, dict):
            raise self._corrupt(METADATA_JSON, "no storage data")
        for index, loc in storage_data.items():
            if not isinstance(loc, ItemLocation):
                raise self._corrupt(METADATA_JSON, f"item {index.fqn!r} has no location")
            record = self.manifest.files.get(loc.relative_path)
            if record is None:
                raise self._corrupt(
                    loc.relative_path, f"holds item {index.fqn!r} but is not in the manifest"
                )
            if loc.offset + loc.length > record.size:
                raise self._corrupt(
                    loc.relative_path,
                    f"item {index.fqn!r} ends at byte {loc.offset + loc.length}, "
                    f"past the file's {record.size} bytes",
                )

    def _fetch(self, locations: list[ItemLocation]) -> Iterator[tuple[ItemLocation, memoryview]]:
        """Yield each location with its verified payload; IN_FLIGHT windows read ahead."""
        per_file: dict[str, list[ItemLocation]] = {}
        for loc in locations:
            per_file.setdefault(loc.relative_path, []).append(loc)
        windows = [w for name in sorted(per_file) for w in plan_windows(name, per_file[name])]
        assembling: dict[ItemLocation, tuple[bytearray, list[int]]] = {}
        for window, data in self._read_ahead(windows):
            for loc in window.locations:
                lo, hi = loc.payload_offset, loc.payload_offset + loc.payload_length
                if window.start <= lo and hi <= window.end:  # whole payload: no copy
                    payload = data[lo - window.start : hi - window.start]
                else:  # one part of a payload split over windows
                    buf, left = assembling.setdefault(loc, (bytearray(hi - lo), [hi - lo]))
                    a, b = max(lo, window.start), min(hi, window.end)
                    buf[a - lo : b - lo] = data[a - window.start : b - window.start]
                    left[0] -= b - a
                    if left[0]:
                        continue
                    payload = memoryview(assembling.pop(loc)[0])
                self._verify_payload(loc, payload)
                yield loc, payload

    def _read_ahead(self, windows: list[Window]) -> Iterator[tuple[Window, memoryview]]:
        """Each window with its bytes, in order, with up to IN_FLIGHT reads running."""
        with ThreadPoolExecutor(
            IN_FLIGHT, thread_name_prefix="unbroken-read", initializer=name_native_thread
        ) as pool:
            pending: deque[tuple[Window, PoolFuture[Any]]] = deque()
            for window in windows:
                pending.append(
                    (window, pool.submit(self._read_range, window.file, window.start, window.end))
                )
                if len(pending) > IN_FLIGHT:
                    yield self._checked(*pending.popleft())
            while pending:
                yield self._checked(*pending.popleft())

    def _checked(self, window: Window, fut: PoolFuture[Any]) -> tuple[Window, memoryview]:
        data = memoryview(fut.result())
        if len(data) != window.end - window.start:
            raise self._corrupt(
                window.file,
                f"short file: bytes [{window.start}, {window.end}) gave {len(data)}",
            )
        return window, data

    def _verify_payload(self, loc: ItemLocation, payload: memoryview) -> None:
        if self.verify:
            self._check_crc(loc, crc32c_bytes(payload))

    def _check_crc(self, loc: ItemLocation, crc: int) -> None:
        if crc != loc.crc32c:
            end = loc.payload_offset + loc.payload_length
            raise self._corrupt(
                loc.relative_path,
                f"crc32c mismatch in bytes [{loc.payload_offset}, {end}): "
                f"{crc:#010x}, expected {loc.crc32c:#010x}",
            )

    # -- reading straight into the targets ---------------------------------------

    def _read_direct(
        self,
        direct: dict[ItemLocation, DirectRead],
        planner: LoadPlanner,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Read every payload into its target, each checked as it lands: a local file's
        IN_FLIGHT payloads at a time, a remote's PARTS_IN_FLIGHT ranged reads at a time.
        ``meanwhile`` runs on this thread once they are all under way (the other reads:
        on a far store, one round trip less per load).

        A payload that fails its check has already overwritten its target: the load fails
        as a whole, as it would after the targets of earlier payloads were written."""
        fds: dict[str, int] = {}
        remote = False
        try:
            for name in sorted({loc.relative_path for loc in direct}):
                source = self.source(name)
                if not isinstance(source, LocalStore):
                    remote = True
                    continue
                path = source.path_for(f"{self.prefix}/{name}")
                self.files_read.add(name)
                try:
                    fds[name] = os.open(path, os.O_RDONLY)
                except FileNotFoundError as exc:
                    raise self._corrupt(name, "file is missing") from exc
            order = sorted(direct, key=lambda x: (x.relative_path, x.payload_offset))
            with ThreadPoolExecutor(
                PARTS_IN_FLIGHT if remote else IN_FLIGHT,
                thread_name_prefix="unbroken-read",
                initializer=name_native_thread,
            ) as pool:
                reads: list[tuple[ItemLocation, list[PoolFuture[tuple[int, int]]]]] = []
                for loc in order:
                    memory = direct[loc].memory
                    if loc.relative_path in fds:
                        fd = fds[loc.relative_path]
                        futs = [
                            pool.submit(
                                read_into, fd, loc.payload_offset, memory, checksum=self.verify
                            )
                        ]
                    else:
                        into = np.asarray(memory)
                        futs = [
                            pool.submit(self._read_part_into, loc, into, a, b)
                            for a, b in part_ranges(
                                loc.payload_offset, loc.payload_length, read_plan.PART_BYTES
                            )
                        ]
                    reads.append((loc, futs))
                try:
                    if meanwhile is not None:
                        meanwhile()
                    for loc, futs in reads:
                        got, crc = 0, 0
                        for fut in futs:
                            n, part_crc = fut.result()
                            got, crc = got + n, crc32c_combine(crc, part_crc, n)
                        if got != loc.payload_length:
                            end = loc.payload_offset + loc.payload_length
                            raise self._corrupt(
                                loc.relative_path,
                                f"short file: bytes [{loc.payload_offset}, {end}) gave {got}",
                            )
                        if self.verify:
                            self._check_crc(loc, crc)
                        # As copy_ would: autograd and torn-snapshot checks see the write.
                        increment_version(direct[loc].target)
                        planner.commit_tensor(direct[loc].request, direct[loc].target)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_part_into(
        self, loc: ItemLocation, into: np.ndarray, start: int, end: int
    ) -> tuple[int, int]:
        """Fetch [start, end) of the payload's file into its place in ``into`` (the target's
        bytes); (bytes, their crc32c). Runs on a reader thread: the fetch, the checksum and
        the copy all release the GIL. A store that can receive into memory it is given (a
        peer's) writes straight into the target: no buffer between."""
        source = self.source(loc.relative_path)
        at = start - loc.payload_offset
        if isinstance(source, ReadsInto):
            self.files_read.add(loc.relative_path)
            view = memoryview(into[at : at + end - start]).cast("B")
            try:
                got = source.read_range_into(f"{self.prefix}/{loc.relative_path}", start, end, view)
            except ObjectNotFoundError as exc:
                raise self._corrupt(loc.relative_path, "file is missing") from exc
            if got != end - start:
                raise self._corrupt(
                    loc.relative_path, f"short file: bytes [{start}, {end}) gave {got}"
                )
            return got, crc32c_bytes(view) if self.verify else 0
        data = memoryview(self._read_range(loc.relative_path, start, end)).cast("B")
        if data.nbytes != end - start:
            raise self._corrupt(
                loc.relative_path, f"short file: bytes [{start}, {end}) gave {data.nbytes}"
            )
        crc = crc32c_bytes(data) if self.verify else 0
        into[at : at + data.nbytes] = np.frombuffer(data, dtype=np.uint8)
        return data.nbytes, crc

    # -- handing data to DCP -------------------------------------------------------

    def _deliver(
        self, req: ReadItem, loc: ItemLocation, payload: memoryview, planner: LoadPlanner
    ) -> None:
        fqn = req.storage_index.fqn
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, self._safe_bytes(fqn, loc, payload))
            return
        if loc.dtype is None or loc.shape is None:
            raise self._corrupt(loc.relative_path, f"item {fqn!r} is not a tensor record")
        saved = tensor_from_raw(payload, dtype_from_name(loc.dtype), loc.shape)
        piece = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != piece.size():
            raise CheckpointMismatchError(
                f"step {self.step}: item {fqn!r}: checkpoint has shape {list(piece.size())} "
                f"where the target has {list(target.size())}"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)

    def _safe_bytes(self, fqn: str, loc: ItemLocation, payload: memoryview) -> io.BytesIO:
        """Load a non-tensor value with weights_only=True; re-serialize what is proven safe."""
        try:
            value = load_weights_only(payload)
        except UnsafeValueError as exc:
            raise self._corrupt(
                loc.relative_path,
                f"value {fqn!r} is not loadable with weights_only=True, refused ({exc})",
            ) from exc
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out
