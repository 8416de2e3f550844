"""Private host memory for large buffers that are written to disk again and again.

Why not shared memory: a checkpoint's staging buffers are copied into and written out
with O_DIRECT on every save, and the kernel pins, maps and describes each page of every
write. Measured on these machines with ``bench/checkpoint/write_cost.py`` (two compute-bound
processes beside one O_DIRECT writer, core-seconds they lose per GiB written, two runs):
from shared memory 0.173 and 0.138, from private memory 0.106 and 0.078 with 4 KiB pages,
0.119 and 0.115 with huge pages advised; the writer's own CPU per GiB 0.07 from either
kind of 4 KiB page, 0.04 from huge pages. So: private memory, for what the loop loses,
and huge pages (2 MiB: one entry where there were 512) for the writer's own kernel time.
Shared memory (``/dev/shm``, tmpfs) only gets huge pages where the administrator allows
them for tmpfs (``shmem_enabled``, "never" by default); private anonymous memory gets
them wherever transparent huge pages are "madvise" or "always", the common defaults.

The memory is page-aligned, as O_DIRECT needs, and private to the process: a worker
thread writes it in place; another process cannot. It is not inherited by ``fork``
(``MADV_DONTFORK``): DataLoader workers are forked from the training process, and
private pages shared with a child are copied on the parent's next write, so every save
after a fork would first pay a page fault and a copy for every page (and the child would
keep the old copy of a whole staging pool). Shared memory never had that cost.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
"""Size of a transparent huge page on x86-64 and arm64 with 4 KiB base pages."""

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)


def host_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` (at least one page) of private, page-aligned memory, left out of forked
    children; huge pages advised from 2 MiB up.

    The length is not rounded up to whole huge pages: the kernel then backs the aligned
    interior with huge pages and the ends with small ones, instead of a whole 2 MiB page
    for a tail of a few bytes (up to 2 MiB per buffer, in a pool of hundreds of them).
    """
    if nbytes < 0:
        raise ValueError(f"host_buffer: nbytes must be >= 0, got {nbytes}")
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _MADV_DONTFORK is not None:
        buf.madvise(_MADV_DONTFORK)
    if nbytes >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except OSError:  # THP compiled out or disabled: 4 KiB pages still work
            pass
    return buf


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in :func:`host_buffer` memory.

    The tensor holds a reference to its mapping, which is unmapped once the tensor and
    every view of it are gone.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    buf = host_buffer(count * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
