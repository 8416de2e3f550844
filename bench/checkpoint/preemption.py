"""What preemption handling costs the loop, and how long a grace period a save needs.

Two ranks under torchrun (gloo, CPU). Two figures, side by side with their baselines:
- per maybe_save call with SIGTERM handling on (one tiny async all_reduce per call) and
  off (no collective at all on a step that is not due), in ABAB rounds;
- from SIGTERM to the committed checkpoint (what the scheduler's grace period must
  cover), by state size, over the standard emulated remote (20 ms, 200 MB/s per node).

    python -m bench.checkpoint.preemption [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import unbroken as ub
from bench.common.paths import ROOT, child_env


def _call_cost(root: str, preemption: str, calls: int) -> float:
    """Microseconds per maybe_save call on a step that is not due."""
    weights = torch.nn.Linear(64, 64)
    state = {"model": weights}
    mgr = ub.CheckpointManager(
        os.path.join(root, preemption), staging_dir=os.path.join(root, f"st-{preemption}"),
        every_steps=10**9, preemption=preemption,
    )  # fmt: skip
    a = torch.randn(128, 128)
    grad = torch.zeros(1024)
    spent = 0.0
    for step in range(1, calls + 1):
        a = (a @ a).tanh_()  # some work between calls, as a loop has
        dist.all_reduce(grad)  # and the gradient sync that keeps data-parallel ranks in step
        t0 = time.perf_counter()
        mgr.maybe_save(step, state)
        spent += time.perf_counter() - t0
    mgr.close()
    return spent / calls * 1e6


def _grace(root: str, nbytes: int) -> float:
    """Seconds from SIGTERM (on rank 0) to its save committed, one rank's share ``nbytes``."""
    url = "emulated::" + os.path.join(root, f"grace-{nbytes}")
    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(nbytes // 4 // 8)) for _ in range(8)]
    )
    state = {"params": params}
    mgr = ub.CheckpointManager(
        url, staging_dir=os.path.join(root, f"gst-{nbytes}-{dist.get_rank()}"),
        every_steps=10**9, preemption="flag",
    )  # fmt: skip
    sent = None
    for step in range(1, 1000):
        time.sleep(0.01)  # a step
        if step == 5 and dist.get_rank() == 0:
            sent = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)
        mgr.maybe_save(step, state)
        if mgr.preempted:
            break
    seconds = time.perf_counter() - sent if sent is not None else 0.0
    mgr.close()
    return seconds


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    root = args.root
    calls = 300 if args.quick else 2000
    rounds = 2 if args.quick else 4
    on, off = [], []
    for _ in range(rounds):
        on.append(_call_cost(root, "exit", calls))
        off.append(_call_cost(root, "off", calls))
    sizes = [16 << 20, 64 << 20] if args.quick else [16 << 20, 64 << 20, 256 << 20]
    grace = {n: _grace(root, n) for n in sizes}
    if dist.get_rank() == 0:
        print(f"{'per maybe_save call':<34}{'handling on':>14}{'off':>10}")
        print(
            f"{'microseconds (mean of rounds)':<34}{statistics.mean(on):>14.1f}"
            f"{statistics.mean(off):>10.1f}"
        )
        print()
        print(f"{'state per rank':<18}{'SIGTERM -> committed (s)':>26}{'bytes/bandwidth (s)':>22}")
        for n, s in grace.items():
            print(f"{n >> 20:>14} MiB{s:>26.2f}{2 * n / 200e6:>22.2f}")
        print(json.dumps({
            "call_us_on": on, "call_us_off": off,
            "grace_seconds": {str(n): s for n, s in grace.items()},
        }))  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, smaller states")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return worker(args)
    with tempfile.TemporaryDirectory() as root:
        env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "-m", "bench.checkpoint.preemption", "--root", root,
            *(["--quick"] if args.quick else []),
        ]  # fmt: skip
        sys.exit(subprocess.call(cmd, env=env, cwd=ROOT))


if __name__ == "__main__":
    main()
