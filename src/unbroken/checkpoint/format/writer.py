"""TierWriter: a DCP StorageWriter that puts one rank's shard into a local directory.

Each rank writes one file, ``__<rank>_0.distcp``, of aligned records: a bytes value as
it is, a tensor as its raw bytes (streamed from the tensor's own memory in bounded
chunks, no copy for a contiguous CPU tensor) inside a torch.load-able envelope (see
:mod:`unbroken.checkpoint.format.tensor_record`). The shard is written with O_DIRECT where the
file system allows it: a large payload starts on a 4 KiB file offset and, when its memory
is page-aligned (the staging buffers are), goes to the device from that memory without
taking page-cache pages (:mod:`unbroken._util.direct_io` says why that matters).
crc32c is computed as bytes go out, for each payload (what the reader checks), unless
the staging copy already took it (``known_checksums``); the whole file's (the
manifest's checksum) is folded from those.
Files appear by temp name + fsync + rename + directory fsync (fsync optional). The coordinator's
``finish`` writes ``metadata.json`` (what our reader uses) and ``.metadata`` (pickle, for
vanilla ``dcp.load`` only).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from unbroken._util.crc32c_combine import crc32c_combine
from unbroken._util.direct_io import DirectFileWriter, address_of, new_file_writer
from unbroken.checkpoint.errors import CheckpointError
from unbroken.checkpoint.format.dcp_json import (
    ItemLocation,
    dtype_name,
    metadata_to_json,
    vanilla_metadata,
)
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    METADATA_JSON,
    METADATA_PICKLE,
    FileRecord,
    crc32c_bytes,
)
from unbroken.checkpoint.format.shard_layout import TensorLayout, lay_out
from unbroken.checkpoint.format.tensor_record import envelope, padding, raw_view
from unbroken.checkpoint.format.values import UnsafeValueError, load_weights_only
from unbroken.checkpoint.staging.arena import Arena
from unbroken.checkpoint.staging.copy import buffer_key
from unbroken.storage.base import atomic_local_write

SHARD_SUFFIX = ".distcp"
WRITE_CHUNK = 8 << 20
"""Bytes handed to one write() and one crc32c() call: bounds the time the GIL is held."""


def shard_name(prefix: str, index: int = 0) -> str:
    return f"{prefix}{index}{SHARD_SUFFIX}"


class TierWriter(StorageWriter):
    """Writes this rank's part of a DCP checkpoint into ``directory`` (the staging tier).

    After ``dcp.save(..., storage_writer=w)``, ``w.records`` lists the files this rank
    wrote (name, size, crc32c); on the coordinator it includes the two metadata files.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        sync: bool = True,
        keep_parts: bool = False,
        defer_shards: bool = False,
        known_checksums: Mapping[tuple[int, int], int] | None = None,
        arena: Arena | None = None,
    ) -> None:
        """``sync=False`` skips fsync: for the staging tier, whose copy is used only when
        its manifest matches the durable one and every byte read is checksummed.
        ``keep_parts``: remember each file as the buffers it was written from (``parts``).
        ``defer_shards`` (with ``keep_parts``): the save lays each shard out (its record,
        its parts) without writing it; ``deferred[name]()`` writes it later, so that the
        upload can send the parts from memory while the shard goes to disk.
        ``known_checksums``: crc32c of tensor memory already taken, by ``buffer_key``
        (``StagedState.checksums``); such a payload is written without reading it again.
        ``arena``: the memory tier's file the snapshot was staged into; where the plan
        lays the shard out as the arena is, the shard is that file (``staging/arena.py``).
        """
        super().__init__()
        self.directory = os.fspath(directory)
        self.sync = sync
        self.keep_parts = keep_parts
        self.defer_shards = defer_shards and keep_parts
        self.deferred: dict[str, Callable[[], None]] = {}
        """With ``defer_shards``: per shard laid out, the call that writes it to disk (from
        its parts: they must stay unchanged until it returns)."""
        self.known_checksums: Mapping[tuple[int, int], int] = known_checksums or {}
        self.reused_checksum_bytes = 0
        """Payload bytes written with a checksum from ``known_checksums``."""
        self.arena = arena
        self.in_place_bytes = 0
        """Payload bytes the staging copy had already put in place (``arena``)."""
        self.layout: TensorLayout | None = None
        """This rank's shard's tensor records as last written: where the next save of
        the same state can stage (``RankArenas.take``)."""
        self.records: list[FileRecord] = []
        self.parts: dict[str, list[Any]] = {}
        """With ``keep_parts``: per file written, the buffers whose concatenation is its
        content (headers, padding, and views of the tensors' own memory: no copies). They
        are valid while the tensors saved are unchanged; uploads send from them."""
        self.direct_bytes = 0
        """Bytes of the shard written with O_DIRECT (no page cache)."""
        self.page_cache_used = False
        """True when the shard went, in part or whole, through the page cache (its file
        system refused O_DIRECT)."""
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    # -- StorageWriter --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.directory = os.fspath(checkpoint_id)
        self.records = []
        self.parts = {}
        self.deferred = {}
        self.direct_bytes = 0
        self.page_cache_used = False
        self.reused_checksum_bytes = 0
        self.in_place_bytes = 0
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.directory, exist_ok=True)
        if os.path.exists(os.path.join(self.directory, MANIFEST_NAME)):
            raise CheckpointError(
                f"{self.directory} holds a committed checkpoint ({MANIFEST_NAME}); "
                "refusing to write over it"
            )
        if not self.use_collectives:
            # No global step will name the files: each rank names its own.
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank or 0}_")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=f"__{i}_") if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            raise CheckpointError(
                f"TierWriter: plan has no file prefix ({prefix!r}); "
                "was prepare_global_plan skipped?"
            )
        results = self._write_shard(shard_name(prefix), plan.items, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        # Without collectives each rank is its own coordinator: per-rank names, as DCP's.
        prefix = "" if self.use_collectives else f"__{self.rank or 0}"
        json_name = METADATA_JSON if self.use_collectives else f"{prefix}.{METADATA_JSON}"
        self._write_small(json_name, metadata_to_json(metadata))
        self._write_small(prefix + METADATA_PICKLE, pickle.dumps(vanilla_metadata(metadata)))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.directory, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.directory

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in os.fspath(checkpoint_id)

    # -- files ----------------------------------------------------------------------

    def _write_shard(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        resolved = [(item, planner.resolve_data(item)) for item in items]
        tensors = [(i, d) for i, d in resolved if i.type != WriteItemType.BYTE_IO]
        values = [(i, d) for i, d in resolved if i.type == WriteItemType.BYTE_IO]
        for item, data in tensors:
            self._check_tensor(item, data)
        layout = lay_out(
            (i.index.fqn, tuple(i.index.offset or ()), d.dtype, tuple(d.shape)) for i, d in tensors
        )
        self.layout = layout
        results: list[WriteResult] = []

        def fill(out: _ChecksummedOutput) -> None:
            for (item, data), slot in zip(tensors, layout.slots):
                results.append(self._write_tensor(out, name, item, data, slot.start))
            for item, data in values:
                results.append(self._write_value(out, name, item, data))

        arena = self.arena
        if arena is not None and arena.layout == layout:
            self._publish_in_place(name, fill, arena)
        else:
            self._publish(name, fill, direct=True)
        return results

    def _write_value(
        self, out: _ChecksummedOutput, name: str, item: WriteItem, data: Any
    ) -> WriteResult:
        fqn = item.index.fqn
        out.pad(padding(out.pos))
        start = out.pos
        if not isinstance(data, io.BytesIO):
            raise CheckpointError(
                f"item {fqn!r}: planner gave {type(data).__name__} for a bytes item"
            )
        try:
            load_weights_only(data.getbuffer())
        except UnsafeValueError as exc:
            raise CheckpointError(
                f"item {fqn!r} could not be restored safely: {exc}. Save plain Python "
                "values (int, float, str, list, dict, ...) or tensors instead"
            ) from exc
        payload_crc = out.write(data.getbuffer(), payload=True)
        loc = ItemLocation(name, start, out.pos - start, start, out.pos - start, payload_crc)
        return WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc)

    def _write_tensor(
        self, out: _ChecksummedOutput, name: str, item: WriteItem, data: torch.Tensor, at: int
    ) -> WriteResult:
        """The record at ``at`` (its place in the layout): envelope, raw bytes, trailer."""
        raw = raw_view(data)
        header, trailer = envelope(data.dtype, tuple(data.shape))
        out.pad(at - out.pos)
        start = out.pos
        out.write(header)
        payload_start = out.pos
        known = self._known_checksum(raw)
        payload_crc = out.write(raw, payload=True, crc=known)
        out.write(trailer)
        loc = ItemLocation(
            name,
            start,
            out.pos - start,
            payload_start,
            raw.nbytes,
            payload_crc,
            dtype_name(data.dtype),
            tuple(data.shape),
        )
        return WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc)

    def _known_checksum(self, raw: Any) -> int | None:
        """The checksum taken while staging these very bytes, if any."""
        if not self.known_checksums or raw.nbytes == 0:
            return None
        crc = self.known_checksums.get(buffer_key(raw.ctypes.data, raw.nbytes))
        if crc is not None:
            self.reused_checksum_bytes += raw.nbytes
        return crc

    @staticmethod
    def _check_tensor(item: WriteItem, tensor: Any) -> None:
        td = item.tensor_data
        fqn = item.index.fqn
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"item {fqn!r}: planner gave {type(tensor).__name__} for a tensor item"
            )
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise CheckpointError(
                f"item {fqn!r}: only dense tensors can be saved, got layout {tensor.layout}"
            )
        if td is not None and (
            tuple(tensor.shape) != tuple(td.chunk.sizes) or tensor.dtype != td.properties.dtype
        ):
            raise CheckpointError(
                f"item {fqn!r}: planner resolved a {tensor.dtype} {list(tensor.shape)} "
                f"tensor for a {td.properties.dtype} {list(td.chunk.sizes)} chunk"
            )

    def _write_small(self, name: str, data: bytes) -> None:
        self._publish(name, lambda out: out.write(data))

    def _publish(
        self, name: str, fill: Callable[[_ChecksummedOutput], object], *, direct: bool = False
    ) -> None:
        """Run ``fill(out)`` into a temp file; fsync, rename to ``name``, record it (and
        its parts, with ``keep_parts``). ``direct``: write with O_DIRECT where the file
        system allows."""
        written: list[tuple[int, int]] = []
        parts: list[Any] | None = [] if self.keep_parts else None
        path = os.path.join(self.directory, name)

        def fill_path(_key: str, tmp: str) -> None:
            with new_file_writer(tmp, direct=direct) as sink:
                out = _ChecksummedOutput(sink, parts)
                fill(out)
                written.append((sink.close(), out.crc))
            self._count_direct(sink, direct)

        if self.defer_shards and direct and parts is not None:
            out = _ChecksummedOutput(_NoSink(), parts)
            fill(out)
            written.append((out.pos, out.crc))
            self.deferred[name] = lambda: self._write_parts(path, name, parts)
        else:
            atomic_local_write(path, fill_path, name, sync=self.sync)
        size, crc = written[0]
        self.records = [r for r in self.records if r.name != name]
        self.records.append(FileRecord(name, size, crc))
        if parts is not None:
            self.parts[name] = parts

    def _publish_in_place(
        self, name: str, fill: Callable[[_ChecksummedOutput], object], arena: Arena
    ) -> None:
        """The shard into ``arena``, whose payloads the staging copy already wrote where
        this layout puts them: only what is not in place yet is written (envelopes,
        values, a payload staged elsewhere); then the file is linked in as ``name``."""
        parts: list[Any] | None = [] if self.keep_parts else None
        sink = _ArenaSink(arena)
        out = _ChecksummedOutput(sink, parts)
        fill(out)
        os.ftruncate(arena.fd, out.pos)
        arena.link(os.path.join(self.directory, name))
        self.in_place_bytes += sink.in_place
        self.records = [r for r in self.records if r.name != name]
        self.records.append(FileRecord(name, out.pos, out.crc))
        if parts is not None:
            self.parts[name] = parts

    def _write_parts(self, path: str, name: str, parts: list[Any]) -> None:
        """A deferred shard to disk, from the parts its layout recorded."""

        def fill_path(_key: str, tmp: str) -> None:
            with new_file_writer(tmp, direct=True) as sink:
                for part in parts:
                    sink.write(part)
                sink.close()
            self._count_direct(sink, True)

        atomic_local_write(path, fill_path, name, sync=self.sync)

    def _count_direct(self, sink: DirectFileWriter, direct: bool) -> None:
        if direct:
            self.direct_bytes += sink.direct_bytes
            self.page_cache_used |= not sink.direct


class _NoSink:
    """Where a deferred shard's bytes go while its layout is taken: nowhere."""

    def write(self, data: Any) -> None:
        pass


class _ArenaSink:
    """Writes at the arena's positions, skipping bytes that already sit there."""

    def __init__(self, arena: Arena) -> None:
        self.fd = arena.fd
        self.base = arena.address
        self.pos = 0
        self.in_place = 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if n and address_of(view) == self.base + self.pos:
            self.in_place += n
        else:
            done = 0
            while done < n:
                done += os.pwrite(self.fd, view[done:], self.pos + done)
        self.pos += n


class _ChecksummedOutput:
    """Writes buffers in bounded chunks, keeping the file's crc32c and its position."""

    def __init__(
        self, sink: DirectFileWriter | _NoSink | _ArenaSink, parts: list[Any] | None = None
    ) -> None:
        self.sink = sink
        self.pos = 0
        self.crc = 0
        self.parts = parts
        """Where every buffer written is also appended, when given."""

    def write(self, data: Any, *, payload: bool = False, crc: int | None = None) -> int:
        """Write ``data`` (any buffer); return its own crc32c if ``payload`` else 0.

        Each byte is checksummed once: a payload's own crc32c is folded into the file's
        with ``crc32c_combine``. A payload whose crc32c is already known (``crc``) is
        not checksummed again."""
        view = memoryview(data).cast("B")
        if self.parts is not None:
            self.parts.append(view)
        if crc is not None and not payload:
            raise ValueError("a known crc32c is taken for a payload only")
        own = 0 if payload else self.crc
        for start in range(0, len(view), WRITE_CHUNK):
            chunk = view[start : start + WRITE_CHUNK]
            if crc is None:
                own = crc32c_bytes(chunk, own)
            self.sink.write(chunk)
        if crc is not None:
            own = crc
        self.pos += len(view)
        if not payload:
            self.crc = own
            return 0
        self.crc = crc32c_combine(self.crc, own, len(view))
        return own

    def pad(self, n: int) -> None:
        if n:
            self.write(bytes(n))
