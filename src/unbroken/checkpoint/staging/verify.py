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
its buffer (reads both; about as long as the copy itself, 0.06 s/GiB on one thread here).

CUDA sources are not read back over the host link. The copy's side stream takes a
fingerprint of every source (``device_fingerprints``) before its first copy and again
after its last, and the snapshot is abandoned where any differs. That is stricter than
the comparison above: the buffers are the sources' values at one moment, the start of the
copies (right after the work queued before ``save()``), and a write that landed during
the copies is caught even where it came before a tensor's own copy. Its cost is two reads
of the sources at device-memory speed (about 2 ms per GiB on an H200) instead of the
snapshot once more over the host link (tens of ms per GiB). What it misses besides an
undone write: a change that leaves both sums of the fingerprint as they were (odds of
about 2**-64 for a write of values that are not chosen to collide).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

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


FINGERPRINT_STRIDE = 0x9E3779B97F4A7C15 - (1 << 64)
"""The odd multiplier of a word's position in the second sum (the golden ratio's 64-bit
constant, as a signed int64): a write that moves words around changes that sum."""


def _words(flat: torch.Tensor) -> torch.Tensor:
    """Flat bytes as the widest integers they divide into, int64 where they can be."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if flat.numel() % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def _wrap(value: int) -> int:
    """A Python int as the int64 it wraps to."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def device_fingerprints(
    sources: Sequence[torch.Tensor], slice_bytes: int = VERIFY_SLICE_BYTES
) -> torch.Tensor:
    """Per source, two int64 sums over its bytes read as integers, both wrapping: the
    plain sum and the sum weighted by position (``FINGERPRINT_STRIDE * i + 1``). Any
    single changed word changes the first; a permutation changes the second. Queued on
    the current stream of the sources' device (one device), three or four kernels per
    source of one slice and no transfer to the host, so queuing it never waits for the
    device; the result stays there, an ``(n, 2)`` tensor."""
    if not sources:
        return torch.empty((0, 2), dtype=torch.int64)
    device = sources[0].device
    span = max(1, slice_bytes // 8)
    largest = max(src.numel() * src.element_size() for src in sources)
    weights = torch.arange(min(span, max(1, largest)), dtype=torch.int64, device=device)
    weights.mul_(FINGERPRINT_STRIDE).add_(1)
    sums: list[torch.Tensor] = []
    for src in sources:
        words = _words(source_bytes(src))
        plain: torch.Tensor | int = 0
        placed: torch.Tensor | int = 0
        for begin in range(0, max(1, words.numel()), span):
            piece = words[begin : begin + span].to(torch.int64)
            total = piece.sum()
            # position begin + i weighs FINGERPRINT_STRIDE * (begin + i) + 1
            weighted = (piece * weights[: piece.numel()]).sum()
            if begin:
                weighted = weighted + total * _wrap(FINGERPRINT_STRIDE * begin)
                total, weighted = total + plain, weighted + placed
            plain, placed = total, weighted
        sums += [plain, placed]  # type: ignore[list-item]
    return torch.stack(sums).view(-1, 2)


def changed_on_device(names: Sequence[str], before: torch.Tensor, after: torch.Tensor) -> list[str]:
    """The names whose fingerprints differ (one transfer of the verdicts)."""
    differs = (before != after).any(dim=1).cpu().tolist()
    return [name for name, bad in zip(names, differs) if bad]
