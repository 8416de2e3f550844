"""CPU time one checkpoint save costs, per GiB, measured on a quiet machine.

Why a second checkpoint benchmark: where every core trains (as on the 2-core machines
this project is tested on), what a background save costs the training loop is made of
the CPU time it takes from it. bench/checkpoint/saves.py measures that cost as time lost
(wall time), through a few per cent of run-to-run drift; a change that saves 0.1 s of CPU per
save is invisible there. This one measures the CPU itself, in one process, with nothing
training, so such a change shows, and says how far a save is from the least any copy
of the state costs.

Rows (the same state: ``--gib`` of fp32 tensors shaped like one rank's share of the
checkpoint benchmark's model and Adam state):

- ``memcpy floor``: copy into preallocated buffers, what any snapshot costs;
- ``torch.save``: to a new local file (through the page cache);
- ``dcp.save``: ``FileSystemWriter`` into a new local directory;
- ``unbroken``: ``CheckpointManager.save`` then ``wait()``: staging copy, the local tier
  (O_DIRECT, crc32c), upload to the emulated remote (standard profile) and commit.

Columns are medians over ``--saves`` saves after one warm-up: CPU seconds per GiB of
the whole machine (``/proc/stat``, kernel threads included, less what the machine was
busy with before the row), that as a multiple of the memcpy floor's, and wall seconds;
``--all-columns`` adds this process's user and system CPU per GiB. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp

import unbroken as ub
from bench.checkpoint.measure import cpu_clocks
from unbroken.storage.link import discard_link

GiB = 1 << 30


@dataclass
class Sample:
    """One save's cost."""

    user: float
    system: float
    machine: float
    wall: float


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy since boot (all cores)."""
    return cpu_clocks().machine_s


def idle_rate(seconds: float = 1.0) -> float:
    """Cores the machine keeps busy with nothing of ours running."""
    before = machine_busy()
    time.sleep(seconds)
    return (machine_busy() - before) / seconds


def measure(save: Callable[[int], None], index: int, background: float) -> Sample:
    r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), machine_busy(), time.perf_counter()
    save(index)
    wall = time.perf_counter() - t0
    r1, m1 = resource.getrusage(resource.RUSAGE_SELF), machine_busy()
    return Sample(
        user=r1.ru_utime - r0.ru_utime,
        system=r1.ru_stime - r0.ru_stime,
        machine=max(0.0, m1 - m0 - background * wall),
        wall=wall,
    )


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """Tensors of 32 MiB (a 4096 x 4096 layer's half, and its two Adam moments)."""
    state: dict[str, torch.Tensor] = {}
    per_tensor = 2048 * 4096
    count = max(1, round(gib * GiB / 4 / per_tensor))
    rows = max(1, int(gib * GiB / 4 / count / 4096))
    for i in range(count):
        state[f"t{i:03d}"] = torch.rand(rows, 4096)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def rows(
    state: dict[str, torch.Tensor], work: str
) -> tuple[dict[str, Callable[[int], None]], Callable[[], object]]:
    """Each row's function, which does save number ``i`` and returns once it is complete;
    and what to call when done."""
    floor = {k: torch.empty_like(t) for k, t in state.items()}

    def memcpy(_i: int) -> None:
        for k, t in state.items():
            floor[k].copy_(t)

    def torch_save(i: int) -> None:
        path = os.path.join(work, f"torch-{i}.pt")
        torch.save(state, path)
        os.unlink(path)

    def dcp_save(i: int) -> None:
        path = os.path.join(work, f"dcp-{i}")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        shutil.rmtree(path)

    link = f"save-cpu-{os.getpid()}"
    mgr = ub.CheckpointManager(
        f"emulated::{os.path.join(work, 'remote')}",
        staging_dir=os.path.join(work, "staging"),
        every_steps=None,
        keep_last=1,
        storage_options={"link": link},
    )

    def unbroken_save(i: int) -> None:
        mgr.save(i + 1, state)
        mgr.wait()

    return {
        "memcpy floor": memcpy,
        "torch.save": torch_save,
        "dcp.save": dcp_save,
        "unbroken": unbroken_save,
    }, lambda: (mgr.close(), discard_link(link))


def table(results: dict[str, dict[str, float]], all_columns: bool = False) -> str:
    """CPU per GiB saved, beside the memcpy floor's; user and system split with all_columns."""
    floor = results["memcpy floor"]["machine"]
    head = f"{'row':<14} {'CPU s per GiB':>13} {'x memcpy floor':>14} {'wall s':>8}"
    if all_columns:
        head += f" {'user s/GiB':>10} {'system s/GiB':>12}"
    lines = [head]
    for name, r in results.items():
        times = f"{r['machine'] / floor:>13.1f}x" if floor else f"{'n/a':>14}"
        line = f"{name:<14} {r['machine']:>13.3f} {times} {r['wall']:>8.2f}"
        if all_columns:
            line += f" {r['user']:>10.3f} {r['system']:>12.3f}"
        lines.append(line)
    lines.append("CPU: the whole machine's, beyond its idle rate, while the save ran")
    return "\n".join(lines)


def _key(row: str) -> str:
    return row.replace(" ", "_").replace(".", "_")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.5, help="GiB of state (1.5; quick 0.06)")
    p.add_argument("--saves", type=int, default=3, help="measured saves per row (3)")
    p.add_argument("--quick", action="store_true", help="small state, one save: seconds")
    p.add_argument("--work-dir", default=None, help="where the files go (a temp dir)")
    p.add_argument("--all-columns", action="store_true", help="also user and system CPU")
    a = p.parse_args(argv)
    gib = 0.0625 if a.quick and a.gib == 1.5 else a.gib
    saves = 1 if a.quick else a.saves
    if gib <= 0 or saves < 1:
        p.error("--gib must be positive and --saves at least 1")
    torch.set_num_threads(1)  # as in a rank under torchrun
    state = make_state(gib)
    size_gib = state_bytes(state) / GiB
    work = tempfile.mkdtemp(prefix="unbroken-save-cpu-", dir=a.work_dir)
    results: dict[str, dict[str, float]] = {}
    try:
        funcs, close = rows(state, work)
        try:
            for name, save in funcs.items():
                save(0)  # warm-up: buffers, first-use costs
                background = idle_rate()
                samples = [measure(save, i + 1, background) for i in range(saves)]
                results[name] = {
                    f: statistics.median(getattr(s, f) for s in samples) / size_gib
                    if f != "wall"
                    else statistics.median(s.wall for s in samples)
                    for f in ("user", "system", "machine", "wall")
                }
        finally:
            close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"state: {size_gib:.2f} GiB in {len(state)} tensors; medians of {saves} save(s)")
    print(table(results, a.all_columns))
    floor = results["memcpy floor"]["machine"]
    summary = {
        "gib": round(size_gib, 3),
        "saves": saves,
        **{f"{_key(k)}_cpu_s_per_gib": round(v["machine"], 4) for k, v in results.items()},
        **{
            f"{_key(k)}_process_cpu_s_per_gib": round(v["user"] + v["system"], 4)
            for k, v in results.items()
        },
        "unbroken_over_floor": round(results["unbroken"]["machine"] / floor, 2) if floor else None,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
