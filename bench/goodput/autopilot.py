"""What every_seconds="auto" buys against fixed save intervals, under injected failures.

Each configuration trains the same loop (a ~64 MiB model, a step of ~30 ms) for the same
wall-clock budget, in a process that is SIGKILLed at the same random moments
(exponential gaps, mean ``--mtbf`` seconds) and restarted at once; it resumes from its
newest committed checkpoint by itself. Goodput (productive / wall) comes from the job's
own event log, as ``unbroken goodput`` reads it. Rows: fixed intervals; "auto" told the
MTBF; "auto" estimating it from its own event log (it starts from a prior of one failure
an hour, so on a run of a few minutes it saves less often than the optimum).

    python -m bench.goodput.autopilot [--quick] [--mtbf 12] [--budget 120]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from bench.common.paths import ROOT, child_env, module_argv


def worker(url: str, staging: str, every: str, mtbf: float | None) -> None:
    import torch

    import unbroken as ub

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    cadence = "auto" if every.startswith("auto") else float(every)
    mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=None,
                               every_seconds=cadence, mtbf=mtbf, keep_last=2)  # fmt: skip
    step = mgr.restore(state) or 0
    x = torch.randn(4, 1024)
    while True:
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        time.sleep(0.02)  # the rest of a step, off the CPU (a GPU would be busy here)
        step += 1
        mgr.maybe_save(step, state)


def run(name: str, every: str, mtbf: float | None, kills: list[float], budget: float,
        tmp: str) -> dict:  # fmt: skip
    url = os.path.join(tmp, name, "ckpt")
    staging = os.path.join(tmp, name, "staging")
    cmd = module_argv("bench.goodput.autopilot", "--worker", url, staging, every,
                      "" if mtbf is None else str(mtbf))  # fmt: skip
    env = child_env(OMP_NUM_THREADS="1")
    start = time.monotonic()
    pending = list(kills)
    while time.monotonic() - start < budget:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        while proc.poll() is None and time.monotonic() - start < budget:
            time.sleep(0.02)
            if pending and time.monotonic() - start >= pending[0]:
                pending.pop(0)
                proc.send_signal(signal.SIGKILL)
        if proc.poll() is None:  # the budget is spent: preempt it (saves, logs its end)
            proc.send_signal(signal.SIGTERM)
        proc.wait()
    import unbroken as ub
    from unbroken.goodput.breakdown import job_breakdown
    from unbroken.goodput.events import read_log

    b = job_breakdown(read_log(ub.open_store(url)), 0)
    intervals = [e.info["seconds"] for by_rank in read_log(ub.open_store(url)).values()
                 for e in by_rank.get(0, []) if e.kind == "interval"]  # fmt: skip
    return {
        "name": name,
        "goodput": b.goodput,
        "wall": b.wall_seconds,
        "restarts": b.restarts,
        "productive": b.seconds["productive"],
        "wasted": b.seconds["wasted"],
        "checkpoint_save": b.seconds["checkpoint_save"],
        "interval": intervals[-1] if intervals else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 s per configuration")
    parser.add_argument("--mtbf", type=float, default=12.0, help="mean seconds between kills")
    parser.add_argument("--budget", type=float, default=None, help="seconds per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        url, staging, every, mtbf = args.worker
        return worker(url, staging, every, float(mtbf) if mtbf else None)
    budget = args.budget or (40.0 if args.quick else 120.0)
    rng = random.Random(args.seed)
    kills, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / args.mtbf)
        if t >= budget - 1:
            break
        kills.append(t)
    configs = [("every 1 s", "1", None), ("every 5 s", "5", None), ("every 20 s", "20", None),
               ("auto, told the MTBF", "auto", args.mtbf),
               ("auto, estimated", "auto-estimated", None)]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from tqdm import tqdm

        bar = tqdm(configs, desc="configurations", unit="cfg", file=sys.stderr)
        for name, every, mtbf in bar:
            bar.set_postfix_str(name)
            rows.append(run(name.replace(" ", "_").replace(",", ""), every, mtbf, kills,
                            budget, tmp) | {"name": name})  # fmt: skip
    print(f"\n{len(kills)} kills in {budget:.0f} s per configuration (mean gap {args.mtbf} s)")
    print(f"{'save interval':<22}{'goodput':>9}{'redone s':>10}{'saving s':>10}"
          f"{'interval chosen':>17}")  # fmt: skip
    for r in rows:
        chosen = f"{r['interval']:.1f} s" if r["interval"] else "-"
        print(f"{r['name']:<22}{r['goodput']:>9.1%}{r['wasted']:>10.1f}"
              f"{r['checkpoint_save']:>10.1f}{chosen:>17}")  # fmt: skip
    print(json.dumps({"kills": kills, "rows": rows}))


if __name__ == "__main__":
    main()
