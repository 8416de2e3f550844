"""DCP ``Metadata`` as JSON, so loading a checkpoint never unpickles anything.

``metadata.json`` carries everything torch 2.13's ``Metadata`` holds: the per-key storage
metadata (tensor properties, global size, chunks; or "bytes"), the storage data (where
each item lives: :class:`ItemLocation`), the planner data (the default planner's
flattening map), the storage meta and the DCP version. Decoding validates every field
and names the file on any defect; dtypes, layouts and memory formats are looked up by
name among torch's own instances, never by importing what the file says.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from unbroken.checkpoint.errors import CheckpointCorruptError

JSON_FORMAT = "unbroken-dcp-metadata"
JSON_VERSION = 1


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item (a tensor chunk or a bytes value) lives in a shard file.

    ``offset``/``length`` span the whole record (what vanilla DCP hands to torch.load);
    ``payload_offset``/``payload_length`` the raw bytes our reader uses, whose crc32c is
    ``crc32c``. ``dtype``/``shape`` describe a tensor payload; None for bytes.
    """

    relative_path: str
    offset: int
    length: int
    payload_offset: int
    payload_length: int
    crc32c: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def to_vanilla(self) -> _StorageInfo:
        """The storage info torch's FileSystemReader understands."""
        return _StorageInfo(self.relative_path, self.offset, self.length)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise ValueError(f"unknown {what} {name!r}")
    return value


def dtype_from_name(name: Any) -> torch.dtype:
    return _torch_attr(name, torch.dtype, "dtype")


# -- encode -------------------------------------------------------------------------


def metadata_to_json(metadata: Metadata) -> bytes:
    """Encode a Metadata whose storage_data maps MetadataIndex -> ItemLocation."""
    storage = metadata.storage_data or {}
    doc = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": {
            fqn: _encode_storage_md(md) for fqn, md in metadata.state_dict_metadata.items()
        },
        "storage_data": [_encode_location(idx, loc) for idx, loc in storage.items()],
        "planner_data": _encode_value(metadata.planner_data, "planner_data"),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _encode_storage_md(md: Any) -> dict:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(md, TensorStorageMetadata):
        raise TypeError(f"cannot encode storage metadata of type {type(md).__name__}")
    p = md.properties
    return {
        "type": "tensor",
        "size": list(md.size),
        "properties": {
            "dtype": dtype_name(p.dtype),
            "layout": str(p.layout).removeprefix("torch."),
            "requires_grad": bool(p.requires_grad),
            "memory_format": str(p.memory_format).removeprefix("torch."),
            "pin_memory": bool(p.pin_memory),
        },
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
    }


def _encode_location(index: MetadataIndex, loc: Any) -> dict:
    if not isinstance(loc, ItemLocation):
        raise TypeError(
            f"storage data for {index.fqn!r} is a {type(loc).__name__}, "
            "not an ItemLocation (was it written by TierWriter?)"
        )
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "file": loc.relative_path,
        "record": [loc.offset, loc.length],
        "payload": [loc.payload_offset, loc.payload_length],
        "crc32c": loc.crc32c,
        "dtype": loc.dtype,
        "shape": None if loc.shape is None else list(loc.shape),
    }


def _encode_storage_meta(sm: StorageMeta | None) -> dict | None:
    if sm is None:
        return None
    cid = sm.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else os.fspath(cid),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": list(sm.modules),
    }


def _encode_value(value: Any, where: str) -> Any:
    """JSON with tuples kept apart from lists (the planner's object paths are tuples)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if "__tuple__" in value:
            raise ValueError(f"{where}: the key '__tuple__' is reserved")
        return {k: _encode_value(v, where) for k, v in value.items()}
    raise TypeError(f"{where}: cannot encode a {type(value).__name__} as JSON")


# -- decode -------------------------------------------------------------------------


def metadata_from_json(data: bytes, *, where: str) -> Metadata:
    """Decode ``metadata.json``; any defect raises CheckpointCorruptError naming ``where``."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT:
            raise ValueError("not an unbroken DCP metadata document")
        if doc.get("version") != JSON_VERSION:
            raise ValueError(f"unsupported version {doc.get('version')!r}")
        sd_md = {
            str(fqn): _decode_storage_md(md)
            for fqn, md in _as(dict, doc["state_dict_metadata"]).items()
        }
        storage: dict[MetadataIndex, ItemLocation] = {}
        for entry in _as(list, doc["storage_data"]):
            index, loc = _decode_location(entry)
            storage[index] = loc
        sm = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata=sd_md,
            planner_data=_decode_value(doc.get("planner_data")),
            storage_data=storage,
            storage_meta=None
            if sm is None
            else StorageMeta(
                checkpoint_id=sm.get("checkpoint_id"),
                save_id=sm.get("save_id"),
                load_id=sm.get("load_id"),
                modules=[str(m) for m in sm.get("modules", [])],
            ),
            version=doc.get("dcp_version"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(
            f"{where}: malformed checkpoint metadata ({type(exc).__name__}: {exc})",
            file=os.path.basename(where),
            url=where,
        ) from exc


def _as(kind: type, value: Any) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    items = tuple(_as(list, value))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ValueError(f"expected non-negative integers, got {value!r}")
    return items


def _decode_storage_md(md: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    kind = _as(dict, md).get("type")
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise ValueError(f"unknown item type {kind!r}")
    p = _as(dict, md["properties"])
    props = TensorProperties(
        dtype=dtype_from_name(p["dtype"]),
        layout=_torch_attr(p.get("layout", "strided"), torch.layout, "layout"),
        requires_grad=bool(p.get("requires_grad", False)),
        memory_format=_torch_attr(
            p.get("memory_format", "contiguous_format"), torch.memory_format, "memory format"
        ),
        pin_memory=bool(p.get("pin_memory", False)),
    )
    size = torch.Size(_ints(md["size"]))
    chunks = [
        ChunkStorageMetadata(
            offsets=torch.Size(_ints(c["offsets"])), sizes=torch.Size(_ints(c["sizes"]))
        )
        for c in _as(list, md["chunks"])
    ]
    for c in chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size):
            raise ValueError(f"chunk {c} does not match tensor size {list(size)}")
    return TensorStorageMetadata(properties=props, size=size, chunks=chunks)


def _decode_location(entry: Any) -> tuple[MetadataIndex, ItemLocation]:
    e = _as(dict, entry)
    offset = e.get("offset")
    index = e.get("index")
    if index is not None and not isinstance(index, int):
        raise TypeError(f"index hint {index!r} is not an int")
    midx = MetadataIndex(str(e["fqn"]), None if offset is None else _ints(offset), index)
    rel = _as(str, e["file"])
    if not rel or rel.startswith("/") or ".." in rel.split("/"):
        raise ValueError(f"bad shard file name {rel!r}")
    rec_off, rec_len = _ints(e["record"])
    pay_off, pay_len = _ints(e["payload"])
    if not (rec_off <= pay_off and pay_off + pay_len <= rec_off + rec_len):
        raise ValueError(f"payload {[pay_off, pay_len]} outside record {[rec_off, rec_len]}")
    dtype = e.get("dtype")
    shape = e.get("shape")
    if dtype is not None:
        dtype = dtype_name(dtype_from_name(dtype))
        shape = _ints(shape)
    crc = e["crc32c"]
    if not isinstance(crc, int) or not 0 <= crc < 2**32:
        raise ValueError(f"bad crc32c {crc!r}")
    return midx, ItemLocation(
        rel, rec_off, rec_len, pay_off, pay_len, crc, dtype, None if shape is None else tuple(shape)
    )


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode_value(v) for v in _as(list, value["__tuple__"]))
        return {k: _decode_value(v) for k, v in value.items()}
    return value


def vanilla_metadata(metadata: Metadata) -> Metadata:
    """A copy whose storage_data torch's own FileSystemReader can follow (for pickling)."""
    storage = {idx: loc.to_vanilla() for idx, loc in (metadata.storage_data or {}).items()}
    return Metadata(
        state_dict_metadata=metadata.state_dict_metadata,
        planner_data=metadata.planner_data,
        storage_data=storage,
        storage_meta=metadata.storage_meta,
        version=metadata.version,
    )
