"""How one tensor sits in a shard file: raw bytes inside a torch.load-able envelope.

Our reader needs only the raw bytes (dtype and shape come from ``metadata.json``). Vanilla
``dcp.load`` (``FileSystemReader``) instead calls ``torch.load`` on each item's byte range.
So each tensor record is the zip container ``torch.save`` would make, but built without
torch serializing the tensor: ``torch.serialization.skip_data`` makes torch.save emit the
container with a hole where the storage bytes go; we keep the bytes before the hole (the
header) and after it (the trailer), and the writer streams the tensor's own memory into
the hole. The zip's CRC-32 of the data entry is not filled in (torch.load does not check
it, as with torch's own ``compute_crc32=False``); our integrity check is crc32c.
"""

from __future__ import annotations

import functools
import io
import sys
import warnings

import numpy as np
import torch

from unbroken._util.direct_io import DIRECT_ALIGN

ALIGNMENT = 64
"""Records start at multiples of this in a shard file, so payloads are aligned too."""
DIRECT_PAYLOAD_MIN = 64 << 10
"""Payloads of at least this many bytes start on a DIRECT_ALIGN file offset, so that the
writer can hand their memory to the device as it is (O_DIRECT). The padding costs at most
4 KiB per such payload (6% at this size, nothing at model scale)."""


class _EnvelopeSink(io.RawIOBase):
    """A write-only stream that keeps written bytes and notes where torch skipped data."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[bytearray] = [bytearray()]
        self.holes: list[int] = []
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:  # type: ignore[override]
        n = len(memoryview(b).cast("B"))
        self.parts[-1] += b
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise io.UnsupportedOperation("envelope sink only skips forward")
        if target > self.pos:
            self.holes.append(target - self.pos)
            self.parts.append(bytearray())
            self.pos = target
        return self.pos


@functools.lru_cache(maxsize=4096)
def envelope(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(header, trailer) that make ``header + raw + trailer`` a torch.save file.

    ``raw`` must be the C-contiguous bytes of a tensor of ``dtype`` and ``shape``.
    Cached: one torch.save costs ~0.3 ms, and a model's parameters and their optimizer
    states share a few shapes.
    """
    if sys.byteorder != "little":  # the raw bytes are native; the envelope says little
        raise RuntimeError("unbroken checkpoints require a little-endian host")
    template = torch.empty(shape, dtype=dtype)  # never touched: no pages are committed
    sink = _EnvelopeSink()
    with torch.serialization.skip_data():
        torch.save(template, sink)
    nbytes = template.numel() * template.element_size()
    if nbytes == 0:
        if sink.holes:
            raise AssertionError(f"torch.save skipped {sink.holes} bytes of an empty tensor")
        return bytes(sink.parts[0]), b""
    if sink.holes != [nbytes] or len(sink.parts) != 2:
        raise AssertionError(
            f"torch.save envelope for {dtype} {list(shape)}: expected one {nbytes}-byte "
            f"hole, got {sink.holes}"
        )
    return bytes(sink.parts[0]), bytes(sink.parts[1])


def raw_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array sharing its memory (copies only if it must).

    A non-contiguous, conjugated or negated view is materialized once; a contiguous CPU
    tensor is never copied.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_from_raw(
    data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``data`` (its raw little-endian bytes)."""
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * torch._utils._element_size(dtype)
    if len(data) != expected:
        raise ValueError(
            f"{len(data)} bytes for a {dtype} tensor of shape {list(shape)} (expected {expected})"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only buffers are fine: we only copy out of them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def padding(offset: int) -> int:
    """Bytes to add after ``offset`` to reach the next record boundary."""
    return -offset % ALIGNMENT


def record_start(offset: int, header_size: int, payload_size: int) -> int:
    """Where a tensor record goes when the file so far ends at ``offset``.

    At the next record boundary; for a large payload, further on, so that the payload
    (after ``header_size`` bytes of envelope) starts on a DIRECT_ALIGN boundary.
    """
    start = offset + padding(offset)
    if payload_size >= DIRECT_PAYLOAD_MIN:
        start += -(start + header_size) % DIRECT_ALIGN
    return start
