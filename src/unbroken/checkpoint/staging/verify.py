"""Checking a finished copy against its sources, for writes the version counter misses.

``p.data.fill_(...)`` (an EMA, weight clipping, SWA-style averaging, a hand-written update)
writes a parameter without moving ``p._version``. So once every background copy of a
snapshot has ended, each of its sources is compared byte for byte with its host buffer;
a source that differs was written after its copy began, and the snapshot is abandoned.

What that guarantees, for the tensors copied in the background: every comparison starts
after every copy ended, so when all of them match, each buffer equals its source over the
whole span from the end of its own copy to the start of its comparison, and those spans
share the moment the copy ended. The buffers are then the sources' values at that one
moment. A write that had landed on a tensor before its copy began is that tensor's value
at that moment and is kept: it cannot be told from a write made before ``save()`` without
reading every byte during ``save()``, which is what overlapping the copy avoids. Two more
things no comparison sees: a write undone to the very same bytes before its comparison,
and an in-place op still running at the moment the copy ends (the snapshot is then that
moment, the tensor part written) that stays ahead of the comparison. A counted op
(``add_``) is caught there by the version check if the verdict is sealed after the op
returned (the step pre-hook seals on the training thread); one through ``.data`` is not.

Cost, in the copy's own background thread: CPU sources one ``memcmp`` of the source with
its buffer (reads both; about as long as the copy itself, 0.06 s/GiB on one thread here);
CUDA sources send the buffer back to the device in slices on the copy's side stream and
compare there (the snapshot's bytes once more over the host link, one slice of device
memory).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

VERIFY_SLICE_BYTES = 32 * 2**20
"""Bytes compared at a time: between two slices an abort (``close()``) takes effect."""


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """libc's memcmp (ctypes releases the GIL around it), or None where there is no libc."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, TypeError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_MEMCMP = _libc_memcmp()


def source_bytes(src: torch.Tensor) -> torch.Tensor:
    """The source's values as flat bytes laid out like its (contiguous) buffer: a view
    where it is contiguous, a copy otherwise (strided, conjugate or negative views)."""
    if not src.is_contiguous() or src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg().contiguous()
    return src.reshape(-1).view(torch.uint8)


def same_bytes_cpu(a: torch.Tensor, b: torch.Tensor, aborted: Callable[[], bool]) -> bool:
    """Two flat uint8 CPU tensors of one length hold the same bytes (True once aborted:
    an aborted job is never used)."""
    n = a.numel()
    for begin in range(0, n, VERIFY_SLICE_BYTES):
        if aborted():
            return True
        k = min(VERIFY_SLICE_BYTES, n - begin)
        if _MEMCMP is not None:
            if _MEMCMP(a.data_ptr() + begin, b.data_ptr() + begin, k) != 0:
                return False
        elif not torch.equal(a[begin : begin + k], b[begin : begin + k]):
            return False
    return True


def differing_on_device(
    pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    on_stream: Callable[[torch.device], AbstractContextManager],
    slice_bytes: int = VERIFY_SLICE_BYTES,
) -> list[str]:
    """Names of device sources whose bytes differ from their host buffers: each buffer goes
    back to its source's device slice by slice, inside ``on_stream(device)`` (the copy's
    side stream, so after its copies), and is compared there; one transfer of the verdicts
    per device. ``pairs``: (name, source, host buffer), none of them empty."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for pair in pairs:
        by_device.setdefault(pair[1].device, []).append(pair)
    names: list[str] = []
    for device, group in by_device.items():
        with on_stream(device):
            largest = max(src.numel() * src.element_size() for _, src, _ in group)
            scratch = torch.empty(min(largest, slice_bytes), dtype=torch.uint8, device=device)
            flags = []
            for _, src, dst in group:
                flat_src, flat_dst = source_bytes(src), dst.reshape(-1).view(torch.uint8)
                differs = torch.zeros((), dtype=torch.bool, device=device)
                for begin in range(0, flat_src.numel(), scratch.numel()):
                    piece = flat_dst[begin : begin + scratch.numel()]
                    back = scratch[: piece.numel()]
                    back.copy_(piece, non_blocking=True)
                    differs |= back.ne(flat_src[begin : begin + piece.numel()]).any()
                flags.append(differs)
            # It waits for this stream's work only, not the training loop's.
            verdicts = torch.stack(flags).cpu().tolist()
        names += [name for (name, _, _), bad in zip(group, verdicts) if bad]
    return names
