"""What an O_DIRECT checkpoint write costs the training beside it, by the memory it is
written from.

Why: on a machine whose cores all train, a background write costs the loop the kernel
work it causes, and most of that work is per page (pinning, mapping, one I/O segment
each). This probe measures that cost the way the loop feels it: two single-threaded,
compute-bound processes (a matmul and a pass over 64 MiB, like a small training step)
count their iterations while a thread of this process writes one buffer over and over
to new files with O_DIRECT, in phases of ``--phase`` seconds:

- ``none``: no writer (the reference of its round);
- ``shared``: the buffer in shared memory (tmpfs), as torch's ``share_memory_()`` makes it;
- ``private_4k``: private anonymous memory held to 4 KiB pages (``MADV_NOHUGEPAGE``);
- ``private_huge``: unbroken's staging memory (``unbroken._util.host_memory``): private,
  huge pages advised.

Each round holds every phase, in an order that alternates forward and backward so that a
steady drift cancels. The cost is the processes' lost throughput, in core-seconds per
GiB written, against the round's ``none`` phase; mean ± standard error over rounds. The
last line is JSON.

    python -m bench.checkpoint.write_cost --quick        # a few seconds: the script works
    python -m bench.checkpoint.write_cost                # 6 rounds of 12 s phases, about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from bench.checkpoint.pairs_math import estimate
from unbroken._util.direct_io import aligned_buffer, new_file_writer
from unbroken._util.host_memory import host_buffer

GiB = 1 << 30
SLICE = 8 << 20
"""Bytes per write call (as the checkpoint writer's large sequential writes)."""
KINDS = ("none", "shared", "private_4k", "private_huge")
WORKERS = 2


def buffer(kind: str, nbytes: int) -> mmap.mmap:
    """``nbytes`` of the named kind of memory, faulted in."""
    if kind == "shared":
        buf = aligned_buffer(nbytes)  # MAP_SHARED | MAP_ANONYMOUS: shmem
    elif kind == "private_4k":
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(getattr(mmap, "MADV_NOHUGEPAGE", mmap.MADV_NORMAL))
    elif kind == "private_huge":
        buf = host_buffer(nbytes)
    else:
        raise ValueError(f"write_cost: no kind of memory {kind!r}; there are {KINDS[1:]}")
    view = memoryview(buf)
    for offset in range(0, len(buf), 4096):
        view[offset] = 1
    view.release()
    return buf


def compute(counter, ready, stop) -> None:
    """One single-threaded, compute-bound process; counts its iterations."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.randn(16 << 20)
    with ready.get_lock():
        ready.value += 1
    while not stop.value:
        for _ in range(4):
            a @ b
        big.mul_(0.999).add_(0.001)
        with counter.get_lock():
            counter.value += 1


@dataclass
class Writer:
    """A thread writing ``buf`` to new files in ``directory`` until stopped."""

    buf: mmap.mmap
    directory: str
    written: int = 0
    cpu: float = 0.0
    direct: bool = True
    """False once a file system refused O_DIRECT (the bytes then went through the page cache)."""

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="write-cost-writer")

    def _run(self) -> None:
        began, view, index = time.thread_time(), memoryview(self.buf), 0
        try:
            while not self.stop.is_set():
                path = os.path.join(self.directory, f"part-{index % 2}.bin")
                with new_file_writer(path, direct=True) as writer:
                    for offset in range(0, len(view), SLICE):
                        if self.stop.is_set():
                            break
                        writer.write(view[offset : offset + SLICE])
                        self.written += min(SLICE, len(view) - offset)
                    writer.close()
                    self.direct = self.direct and writer.direct
                index += 1
        except BaseException as e:  # surfaced by finish()
            self.failure = e
        finally:
            view.release()
            self.cpu = time.thread_time() - began

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.failure is not None:
            raise RuntimeError(f"write_cost: writing to {self.directory} failed") from self.failure


def run_phases(kinds: tuple[str, ...], nbytes: int, phase: float, rounds: int, directory: str):
    """Per kind, per round: (iterations per second, bytes written, writer CPU seconds);
    and whether every write went with O_DIRECT."""
    ctx = mp.get_context("spawn")
    counter, ready, stop = ctx.Value("q", 0), ctx.Value("i", 0), ctx.Value("b", 0)
    procs = [ctx.Process(target=compute, args=(counter, ready, stop)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    buffers = {k: buffer(k, nbytes) for k in kinds if k != "none"}
    results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in kinds}
    direct = True
    try:
        _wait_until_computing(procs, ready)
        time.sleep(min(5.0, phase))  # and settle
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                writer = Writer(buffers[kind], directory) if kind != "none" else None
                if writer:
                    writer.thread.start()
                c0, t0 = counter.value, time.perf_counter()
                time.sleep(phase)
                rate = (counter.value - c0) / (time.perf_counter() - t0)
                if writer:
                    written = writer.written
                    writer.finish()
                    direct = direct and writer.direct
                    results[kind].append((rate, written, writer.cpu))
                else:
                    results[kind].append((rate, 0, 0.0))
                print(f"[write_cost] round {r} {kind}: {rate:.2f} it/s", file=sys.stderr)
    finally:
        stop.value = 1
        for p in procs:
            p.join()
    return results, direct


def _wait_until_computing(procs: list, ready, timeout: float = 300.0) -> None:
    """Until every compute process is in its loop (starting one imports torch: seconds on
    a busy machine); a process that died or never got there is an error."""
    deadline = time.monotonic() + timeout
    while ready.value < len(procs):
        dead = [p.exitcode for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"write_cost: a compute process exited with {dead[0]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"write_cost: compute processes not running after {timeout:g} s")
        time.sleep(0.05)


def report(results: dict[str, list[tuple[float, int, float]]], phase: float) -> str:
    """The table and the JSON line: core-seconds lost per GiB written, by kind of memory."""
    base = [rate for rate, _, _ in results["none"]]
    if not all(base):
        raise ValueError("write_cost: a phase without a writer counted no iterations")
    head = f"{'memory':<14}{'GiB/phase':>10}{'it/s':>9}"
    lines = [head + f"{'core-s lost per GiB':>26}{'writer CPU s/GiB':>18}"]
    lines.append(f"{'none':<14}{0:>10.1f}{statistics.fmean(base):>9.2f}")
    out: dict[str, dict[str, float | None]] = {}
    for kind, rows in results.items():
        if kind == "none":
            continue
        losses = [
            (ref - rate) / ref * WORKERS * phase / (written / GiB)
            for (rate, written, _), ref in zip(rows, base)
            if written
        ]
        e = estimate(losses)
        mean, se = e.mean, e.se
        gib = sum(w for _, w, _ in rows) / GiB
        cpu = sum(c for _, _, c in rows) / gib if gib else float("nan")
        se_text = "n/a" if se is None else f"{se:.3f}"
        lines.append(
            f"{kind:<14}{gib / len(rows):>10.1f}{statistics.fmean(r for r, _, _ in rows):>9.2f}"
            f"{f'{mean:+.3f} ± {se_text}':>26}{cpu:>18.3f}"
        )
        out[kind] = {
            "core_s_per_gib": round(mean, 4),
            "se": None if se is None else round(se, 4),
            "writer_cpu_s_per_gib": round(cpu, 4),
        }
    summary: dict[str, object] = {"core_s_per_gib": out, "rounds": len(base)}
    if "shared" in out and "private_huge" in out and out["private_huge"]["core_s_per_gib"]:
        summary["shared_over_private_huge"] = round(
            out["shared"]["core_s_per_gib"] / out["private_huge"]["core_s_per_gib"], 3
        )
    lines.append(json.dumps(summary, sort_keys=True))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.5, help="GiB in the written buffer (1.5)")
    p.add_argument("--phase", type=float, default=12.0, help="seconds per phase (12)")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every phase (6)")
    p.add_argument("--dir", default="", help="where the files go (a temp dir in $TMPDIR)")
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 s phases, 2 rounds")
    a = p.parse_args(argv)
    if a.quick:
        a.gib, a.phase, a.rounds = 1 / 16, 1.0, 2
    if a.gib <= 0 or a.phase <= 0 or a.rounds < 1:
        p.error("--gib and --phase must be positive and --rounds at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    directory = tempfile.mkdtemp(prefix="write-cost-", dir=a.dir or None)
    try:
        results, direct = run_phases(KINDS, int(a.gib * GiB), a.phase, a.rounds, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    how = "O_DIRECT" if direct else "the page cache (O_DIRECT refused there)"
    print(
        f"{a.rounds} rounds of {a.phase:g} s phases, a {a.gib:g} GiB buffer written through "
        f"{how} beside {WORKERS} compute processes"
    )
    print(report(results, a.phase))
    return 0


if __name__ == "__main__":
    sys.exit(main())
