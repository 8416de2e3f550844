"""Restore after one rank's SIGKILL, same node: from the memory tier, from the disk tier,
against a memcpy of the same bytes in the same process.

A 2-rank torchrun job (DDP, Adam: state = 3x the parameters per rank) commits a step,
one rank is SIGKILLed, torchrun restarts both, and each restarted rank restores: the
memory tier (the default) in one run, ``memory_tier=False`` (the disk staging tier,
written with O_DIRECT, so read from the disk) in the other. Two floors, in the restarted
rank: a copy of the same bytes between two buffers already in memory, and a copy into
memory never touched before (a restarted process allocates its optimizer state as it
restores, and first-touching memory is what costs most on these VMs).

    python -m bench.checkpoint.restore_after_crash [--params-mib 400] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.common.torchrun import ROOT, torchrun_cmd, torchrun_env

JOB = "bench.checkpoint.restore_job"
TIERS = ("memory", "disk")


def one(work: Path, tier: str, params_mib: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{tier}-"))
    cmd = torchrun_cmd(JOB, str(out / "ckpt"), str(out / "stage"), str(params_mib), tier)
    done = subprocess.run(
        cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=900
    )
    rows = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    shutil.rmtree(out, ignore_errors=True)
    if len(rows) != 2:
        raise RuntimeError(f"{tier}: the job gave {len(rows)} results:\n{done.stdout}{done.stderr}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-mib", type=int, default=400, help="parameters per rank (MiB)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="64 MiB of parameters, 1 rep")
    a = p.parse_args()
    params, reps = (64, 1) if a.quick else (a.params_mib, a.reps)
    work = Path(tempfile.mkdtemp(prefix="ub-restore-"))
    print(f"load before: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {t: [] for t in TIERS}
    try:
        for _ in range(reps):  # ABAB: drift in the machine's load hits both alike
            for tier in TIERS:
                runs[tier].extend(one(work, tier, params))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    nbytes = runs["memory"][0]["bytes"]
    print(f"state per rank: {nbytes / 1e9:.2f} GB (DDP + Adam), 2 ranks, {reps} kill(s) per tier")
    print(f"{'tier':<10}{'restored from':>16}{'restore s (median, min-max)':>30}"
          f"{'memcpy s':>10}{'x memcpy':>10}{'1st-touch s':>13}{'x 1st-touch':>13}")  # fmt: skip
    summary = {}
    for tier in TIERS:
        secs = [r["seconds"] for r in runs[tier]]
        floor = statistics.median(r["memcpy"] for r in runs[tier])
        ratio = statistics.median(r["seconds"] / r["memcpy"] for r in runs[tier])
        cold = statistics.median(r["first_touch"] for r in runs[tier])
        cold_ratio = statistics.median(r["seconds"] / r["first_touch"] for r in runs[tier])
        froms = "/".join(sorted({r["tier"] for r in runs[tier]}))
        span = f"{statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f})"
        print(f"{tier:<10}{froms:>16}{span:>30}{floor:>10.3f}{ratio:>9.1f}x"
              f"{cold:>13.3f}{cold_ratio:>12.1f}x")  # fmt: skip
        summary[tier] = {"seconds": secs, "memcpy": floor, "x_memcpy": ratio, "from": froms,
                         "first_touch": cold, "x_first_touch": cold_ratio}  # fmt: skip
    x = summary["memory"]["x_memcpy"]
    print(f"target: memory tier within 3x a memcpy: {x:.1f}x, {'MET' if x <= 3 else 'NOT MET'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
