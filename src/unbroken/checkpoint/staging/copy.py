"""The copy of one snapshot into host buffers: synchronous part, background part, tearing.

A ``Leaf`` is one source tensor and its host buffer. ``copy_now`` copies leaves on the
caller's thread (the keys mutated in forward); ``CopyJob`` copies the rest on a background
thread while the training loop runs forward/backward. ``Tensor.copy_`` releases the GIL,
and the copy goes in chunks so an abort (torn source, ``close()``) takes effect quickly.

Checksums: the background copy also takes each CPU leaf's crc32c, slice by slice, while
the bytes it just wrote are still in the CPU cache (twice as fast here as reading them
again from memory, and one pass over the state fewer). The shard writer uses those
checksums instead of reading the buffers a second time (``StagedState.checksums``).

Tearing: every leaf records its source's ``_version`` when the snapshot is taken. If that
counter moved before the leaf's copy finished, the source was written in place during the
copy and the snapshot is abandoned (``TornSnapshotError``), never kept with mixed values.
torch bumps the counter only after an in-place op has written its data, so a copy running
concurrently can read new data while the counter still shows the old version. The
background thread's checks therefore only abort early; the verdict is sealed later, on
the training thread (the optimizer step pre-hook) or in ``wait()``, once the ops issued
before it have finished and bumped their counters (``CopyJob.seal``). Writes the counter
does not see (through ``.data``) are caught by comparing every source with its buffer once
the whole copy has ended, still on the background thread (``verify``, which says exactly
what that guarantees).

CUDA sources are copied with ``non_blocking=True`` on a side stream that first waits for
the work already queued on the current stream; the background thread then waits on an
event and checks versions. That path needs CUDA and cannot run on a CPU-only machine.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from unbroken._util.priority import lower_thread_priority
from unbroken._util.rest_at_exit import rest_at_exit
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint.format.manifest import crc32c_bytes
from unbroken.checkpoint.staging.verify import differing_on_device, same_bytes_cpu, source_bytes

DEFAULT_CHUNK_BYTES = 32 * 2**20
CHECKSUM_SLICE_BYTES = 4 * 2**20
"""Bytes copied, then checksummed from the cache, at a time (about the cache's size)."""


@dataclass(eq=False)
class Leaf:
    """One tensor of the snapshot: where it comes from and where it goes."""

    name: str
    """Dotted state-dict key, e.g. ``model.fc.weight``."""
    src: torch.Tensor
    """The source tensor (the local shard for a DTensor)."""
    dst: torch.Tensor
    """Its host buffer, same shape and dtype."""
    version: int | None
    """``src._version`` at snapshot time; None for tensors without a version counter."""
    crc32c: int | None = None
    """crc32c of ``dst``'s bytes, taken by the background copy; None where it took none."""

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()

    def changed(self) -> bool:
        return self.version is not None and self.src._version != self.version


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8)


def buffer_key(address: int, nbytes: int) -> tuple[int, int]:
    """How a checksum taken while staging is looked up: the bytes' address and length."""
    return (address, nbytes)


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None where torch does not track one."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def side_stream(device: torch.device, streams: dict[torch.device, object]) -> object:
    """The stager's copy stream on a CUDA device, created once and reused."""
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


@torch.no_grad()
def copy_now(
    leaves: Sequence[Leaf], streams: dict[torch.device, object]
) -> tuple[list[str], list[object]]:
    """Copy leaves before returning to the caller: the names of torn ones, and the CUDA
    events that mark the end of their device copies (for ``CopyJob`` to wait on).

    For CUDA sources "before" means in stream order: the current stream waits for the copy
    to be done, so a later in-place update (BatchNorm statistics in forward) runs after it.
    """
    cuda = [leaf for leaf in leaves if leaf.src.is_cuda]
    events = _enqueue_cuda(cuda, streams, fence_current=True) if cuda else []
    for leaf in leaves:
        if not leaf.src.is_cuda:
            leaf.dst.copy_(leaf.src)
    return [leaf.name for leaf in leaves if leaf.changed()], events


def _enqueue_cuda(
    leaves: Sequence[Leaf], streams: dict[torch.device, object], *, fence_current: bool
) -> list[object]:
    """Queue non-blocking device-to-host copies on each device's side stream; their events."""
    events = []
    by_device: dict[torch.device, list[Leaf]] = {}
    for leaf in leaves:
        by_device.setdefault(leaf.src.device, []).append(leaf)
    for device, group in by_device.items():
        stream = side_stream(device, streams)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)  # sources as of now, after the queued work
        with torch.cuda.stream(stream):
            for leaf in group:
                leaf.dst.copy_(leaf.src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        if fence_current:
            current.wait_event(done)
        events.append(done)
    return events


@dataclass
class CopyJob:
    """The background part of one snapshot; runs once on its own thread."""

    leaves: list[Leaf]
    streams: dict[torch.device, object]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: int = 1
    """Threads for the background copy. 1: each slice is one numpy copy (one thread, the
    GIL released), which leaves torch's thread settings alone. More: torch's own copy
    with that many intra-op threads; ``torch.set_num_threads`` also sets the default of
    threads started meanwhile, so the copy puts the old default back when it ends."""
    checksum: bool = True
    """Take each CPU leaf's crc32c as it is copied (``Leaf.crc32c``)."""
    nice: int = 0
    """Renice the copy thread by this much: it then runs mostly while the training
    threads wait (on collectives, on I/O) instead of taking their turn on the cores."""
    thread_nice: int | None = None
    """The copy thread's nice value as it ran (None where the OS does not say)."""
    finished: threading.Event = field(default_factory=threading.Event)
    torn: list[str] = field(default_factory=list)
    error: BaseException | None = None
    bytes_copied: int = 0
    seconds: float = 0.0
    changed: list[str] = field(default_factory=list)
    """Sources whose bytes differ from their buffers once the copy ended (``verify``):
    written in a way ``_version`` does not show. The first found; the check stops there."""
    verify_seconds: float = 0.0
    """Of ``seconds``, the comparison of the sources with their buffers."""
    complete: bool = False
    """Every leaf was copied (no abort, no torn source cut the copy short)."""
    sealed: bool = False
    """The verdict (``torn``) is final; later writes to the sources are legitimate."""
    checksums: dict[tuple[int, int], int] = field(default_factory=dict)
    """Once sealed whole (complete, nothing torn): each checksummed buffer's crc32c by
    ``buffer_key``."""
    _abort: threading.Event = field(default_factory=threading.Event)
    events: list[object] = field(default_factory=list)
    """CUDA events the job waits for: the copies queued by ``copy_now`` and its own."""
    _seal_lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Queue the CUDA copies now, then copy the CPU leaves on a background thread.

        CUDA copies are queued on the caller's thread so they read the sources as of
        stage(): after the work queued before it, not behind the next forward pass.
        """
        cuda = [leaf for leaf in self.leaves if leaf.src.is_cuda]
        if cuda:
            with torch.no_grad():
                self.events += _enqueue_cuda(cuda, self.streams, fence_current=False)
        _copier(self.nice).put(self)

    def abort(self) -> None:
        """Stop copying as soon as possible; the job then ends as torn or aborted."""
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def _run(self) -> None:
        """The copy, on its copier's thread (``_copier``)."""
        try:
            self.thread_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except (OSError, AttributeError):
            pass
        began = time.perf_counter()
        # A second OpenMP team as wide as the training loop's oversubscribes the cores;
        # one or two threads already copy at memory bandwidth.
        default_threads = torch.get_num_threads() if self.threads > 1 else None
        if default_threads is not None:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                complete = True
                for leaf in self.leaves:
                    if not leaf.src.is_cuda and not self._copy_cpu(leaf):
                        complete = False
                        break
                for event in self.events:
                    event.synchronize()
                self.bytes_copied += sum(leaf.nbytes for leaf in self.leaves if leaf.src.is_cuda)
                if complete and not self.aborted:
                    self.changed = self._verify()
                self.complete = complete and not self.aborted
        except BaseException as exc:  # surfaced by StagedState.wait()
            self.error = exc
        finally:
            if default_threads is not None:
                torch.set_num_threads(default_threads)
            self._quiesce()
            self.events = []
            self.seconds = time.perf_counter() - began
            self.finished.set()

    def seal(self) -> list[str]:
        """Wait for the copy, then fix the verdict: every source whose version moved since
        the snapshot. Call it where the writes that could tear have finished (the training
        thread, before ``optimizer.step``); after it, writes to the sources are fine."""
        self.join()
        with self._seal_lock:
            if not self.sealed:
                # Report every source that moved, not only the first one found.
                self.torn = [leaf.name for leaf in self.leaves if leaf.changed()]
                self.torn += [name for name in self.changed if name not in self.torn]
                if self.complete and not self.torn and self.error is None:
                    self.checksums = {
                        buffer_key(leaf.dst.data_ptr(), leaf.nbytes): leaf.crc32c
                        for leaf in self.leaves
                        if leaf.crc32c is not None
                    }
                self.sealed = True
                self.leaves = []  # do not keep the sources alive any longer
        return self.torn

    def _verify(self) -> list[str]:
        """After every copy ended: the first source whose bytes differ from its buffer
        (CUDA: every one), or none. Stopping at the first keeps the step that waits short."""
        began = time.perf_counter()
        try:
            cuda = [(x.name, x.src, x.dst) for x in self.leaves if x.src.is_cuda and x.nbytes]
            if cuda:
                changed = differing_on_device(cuda, self._on_side_stream)
                if changed:
                    return changed
            for leaf in self.leaves:
                if leaf.src.is_cuda or not leaf.nbytes:
                    continue
                src, dst = source_bytes(leaf.src), flat_bytes(leaf.dst)
                if not same_bytes_cpu(src, dst, self._abort.is_set):
                    return [leaf.name]
            return []
        finally:
            self.verify_seconds = time.perf_counter() - began

    def _on_side_stream(self, device: torch.device) -> object:
        return torch.cuda.stream(side_stream(device, self.streams))

    def _quiesce(self) -> None:
        """After a failure too: no queued device copy may still read a source we drop."""
        for event in self.events:
            try:
                event.synchronize()
            except RuntimeError:  # the CUDA error is already recorded in self.error
                pass

    def _copy_cpu(self, leaf: Leaf) -> bool:
        """Copy one CPU leaf in chunks; False when the job must stop (torn or aborted).

        With ``checksum``, each slice is checksummed right after its copy, from the cache.
        """
        src, dst = leaf.src, leaf.dst
        lazy = src.is_conj() or src.is_neg()  # its bytes are not its values
        if not src.is_contiguous() or lazy or leaf.nbytes == 0:
            self._copy_slice(dst, src)
            self.bytes_copied += leaf.nbytes
            if leaf.changed() or self.aborted:
                return False
            if self.checksum:
                leaf.crc32c = _crc_of(flat_bytes(dst), 0)
            return True
        flat_src, flat_dst = flat_bytes(src), flat_bytes(dst)
        step = min(self.chunk_bytes, CHECKSUM_SLICE_BYTES) if self.checksum else self.chunk_bytes
        crc = 0
        for begin in range(0, leaf.nbytes, step):
            piece = flat_dst[begin : begin + step]
            self._copy_slice(piece, flat_src[begin : begin + step])
            if self.checksum:
                crc = _crc_of(piece, crc)
            self.bytes_copied += piece.numel()
            if leaf.changed() or self.aborted:
                return False
        if self.checksum:
            leaf.crc32c = crc
        return True

    def _copy_slice(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """numpy's copy on this one thread (no torch thread setting to change; the GIL is
        released), or torch's with ``threads`` intra-op threads."""
        if self.threads == 1:
            views = _numpy_views(dst, src)
            if views is not None:
                np.copyto(*views)
                return
        dst.copy_(src)

    def join(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Copier:
    """One long-lived thread that runs the process's copy jobs one after another.

    A thread started and ended for every save could end while a DataLoader forks its
    workers: CPython before 3.11.10 and 3.12 (gh-112275) then leaves the forked worker
    deadlocked on the interpreter's thread-state lock, which an ending thread takes
    (seen once in this project's CI, a demo's worker stuck at an epoch's start). A thread
    that waits for the next job holds no such lock. Reniced once, as it starts.
    """

    def __init__(self, nice: int) -> None:
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._nice = nice
        self._thread = threading.Thread(target=self._serve, name="unbroken-staging", daemon=True)
        self._thread.start()
        rest_at_exit(self)

    def put(self, job: CopyJob) -> None:
        self._jobs.put(job)

    def rest_before_exit(self, deadline: float) -> None:
        """The interpreter ends: the copies queued run, then the thread ends
        (``rest_at_exit``)."""
        if self._thread.is_alive():  # (not in a forked child: the thread stayed behind)
            self._jobs.put(None)
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        name_native_thread()
        if self._nice:
            lower_thread_priority(nice=self._nice)
        while (job := self._jobs.get()) is not None:
            job._run()


_COPIERS: dict[int, _Copier] = {}
"""This process's copiers, by how far they are reniced (one in practice)."""
_COPIERS_LOCK = threading.Lock()


def _copier(nice: int) -> _Copier:
    with _COPIERS_LOCK:
        copier = _COPIERS.get(nice)
        if copier is None:
            copier = _COPIERS[nice] = _Copier(nice)
        return copier


def _forget_copiers_after_fork() -> None:
    """A forked child has none of the parent's threads: its first copy starts its own."""
    global _COPIERS_LOCK
    _COPIERS.clear()
    _COPIERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_copiers_after_fork)


def _numpy_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """Both tensors as numpy arrays of an integer type of their element size (numpy has no
    bfloat16); None where there is none (16-byte elements, conjugate views)."""
    as_int = _INT_OF_SIZE.get(src.element_size())
    if as_int is None or dst.dtype != src.dtype or src.is_conj() or src.is_neg():
        return None
    return dst.view(as_int).numpy(), src.view(as_int).numpy()


def _crc_of(data: torch.Tensor, value: int) -> int:
    """crc32c of a flat uint8 CPU tensor's bytes, continuing from ``value``."""
    return crc32c_bytes(memoryview(data.numpy()), value)
