"""Reading a payload from a local file straight into the memory of the tensor it restores.

The generic read path (a Store's ranged ``read_bytes``) lands bytes in a fresh buffer,
checksums them, then copies them into the tensor: for a local file that is a second pass
over memory plus page faults on every new buffer, which made restoring from the local
tier slower than reading its files. Here the destination tensor's own bytes are the read
buffer: ``preadv`` fills them in bounded chunks and each chunk is checksummed right
after it lands, while it is still in cache. Both calls release the GIL, so several
payloads can be read in parallel threads.

:func:`direct_reads` picks the requests that qualify: the whole saved tensor into a
contiguous target of its dtype and shape (from a remote store too, as ranged parts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from unbroken.checkpoint.format.dcp_json import ItemLocation, dtype_from_name
from unbroken.checkpoint.format.manifest import crc32c_bytes

READ_CHUNK = 8 << 20
"""Bytes per read and checksum call: large sequential reads, still cache-warm for crc32c."""


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """The tensor's own memory as a flat writable byte buffer; None where it has none.

    Only a dense, contiguous CPU tensor without a lazy conjugate or negation qualifies:
    writing the buffer then writes exactly the tensor's elements, in order.
    """
    t = tensor.detach()
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or not t.is_contiguous()
    ):
        return None
    if t.numel() == 0:
        return memoryview(bytearray())
    try:
        array = t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a tensor subclass or dtype numpy cannot view
        return None
    view = memoryview(array)
    return None if view.readonly else view


def read_into(fd: int, offset: int, out: memoryview, *, checksum: bool = True) -> tuple[int, int]:
    """Fill ``out`` from ``fd`` at ``offset``; return (bytes read, crc32c of them).

    Fewer bytes than ``len(out)`` means the file ended first (the caller decides what a
    short file means). The crc is 0 when ``checksum`` is False.
    """
    done, crc = 0, 0
    total = out.nbytes
    while done < total:
        chunk = out[done : min(total, done + READ_CHUNK)]
        got = os.preadv(fd, [chunk], offset + done)
        if got == 0:
            break
        if checksum:
            crc = crc32c_bytes(chunk[:got], crc)
        done += got
    return done, crc


@dataclass(frozen=True)
class DirectRead:
    """A request whose whole payload lands in its target tensor's memory, in place."""

    request: ReadItem
    target: torch.Tensor
    memory: memoryview
    """The target's bytes (``writable_bytes``): the read buffer."""


def direct_reads(
    by_location: dict[ItemLocation, list[ReadItem]], planner: LoadPlanner
) -> dict[ItemLocation, DirectRead]:
    """The payloads that can be read into their target in place: one request for the
    whole saved tensor, a contiguous CPU target of its dtype and shape. Everything else
    (sub-ranges when resharding, values) is fetched in windows."""
    out: dict[ItemLocation, DirectRead] = {}
    for loc, reqs in by_location.items():
        if len(reqs) != 1 or loc.dtype is None or loc.shape is None:
            continue
        req = reqs[0]
        if (
            req.type != LoadItemType.TENSOR
            or any(req.storage_offsets)
            or tuple(req.lengths) != tuple(loc.shape)
        ):
            continue
        try:
            dtype = dtype_from_name(loc.dtype)
        except ValueError:  # the fetch path reports it
            continue
        target = planner.resolve_tensor(req).detach()
        if target.dtype != dtype or tuple(target.shape) != tuple(loc.shape):
            continue
        memory = writable_bytes(target)
        if memory is not None and memory.nbytes == loc.payload_length:
            out[loc] = DirectRead(req, target, memory)
    return out
