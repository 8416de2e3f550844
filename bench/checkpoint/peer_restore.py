"""A replaced node restores from its peer's memory, against S3 alone; and what replication
costs a save.

Two nodes on one machine (a 2-rank torchrun job, each rank a node with its own staging
directory and tmpfs root, as tests/checkpoint's replica tests run them), the durable
tier a real S3 server (SeaweedFS on loopback, or behind a +20 ms delay line). One step
is committed and replicated; node 1 restores from its own memory tier (a process
restart: the floor of the fast path), then is replaced (its staging directory and
memory tier emptied) and restores from its peer's memory, and from S3 alone, each
``reps`` times, interleaved; every restore is checked bitwise. Then a compute loop (one
core of matrix products per rank, the training's stand-in) runs while a save goes on in
the background, with replication on, off, and with no save at all; the loop's extra
wall is the save's cost. Last, both holders of node 1's piece are lost (node 1
replaced, node 0's server killed): node 1 restores from S3, bitwise.

    python -m bench.checkpoint.peer_restore [--mib 1024] [--reps 3] [--window 20]
        [--profile loopback|far] [--quick]
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

from bench.common.s3remote import PROFILES, S3Remote
from bench.common.torchrun import ROOT, torchrun_cmd, torchrun_env

JOB = "bench.checkpoint.peer_restore_job"


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="state per rank (MiB)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--window", type=float, default=20.0, help="compute loop seconds per save")
    p.add_argument("--profile", choices=sorted(PROFILES), default="loopback",
                   help="the S3 server as it is, or behind the +20 ms delay line")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 rep, 2 s loop")
    a = p.parse_args()
    mib, reps, window = (64, 1, 2.0) if a.quick else (a.mib, a.reps, a.window)
    work = Path(tempfile.mkdtemp(prefix="ub-peer-restore-"))
    shm = Path(tempfile.mkdtemp(prefix="ub-peer-restore-", dir="/dev/shm"))
    remote = S3Remote.profile(a.profile, volume_max=800)  # every save keeps ~2 GiB of volumes
    print(f"load before: {os.getloadavg()[0]:.2f}")
    try:
        url = f"s3://{remote.server.new_root()}/ckpt"
        cmd = torchrun_cmd(JOB, url, str(work), str(shm), str(mib), str(reps),
                           json.dumps(remote.storage_options), str(window), restarts=0)  # fmt: skip
        done = subprocess.run(
            cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=1800
        )
    finally:
        where = remote.describe()
        remote.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    rows = {r["rank"]: r for r in (json.loads(line[7:]) for line in done.stdout.splitlines()
                                   if line.startswith("RESULT "))}  # fmt: skip
    if len(rows) != 2:
        raise RuntimeError(f"the job gave {len(rows)} results:\n{done.stdout}{done.stderr}")
    node1 = rows[1]
    gib = node1["bytes"] / (1 << 30)
    print(f"state per rank: {gib:.2f} GiB; 2 nodes of 1 rank on one machine; durable tier: "
          f"{where}")  # fmt: skip
    print(f"replicas sent at the first commit: rank 0 {rows[0]['replicated']}, rank 1 "
          f"{node1['replicated']}")  # fmt: skip
    own = [r["seconds"] for r in node1["restore"]["memory"]]
    peer = [r["seconds"] for r in node1["restore"]["peer"]]
    s3 = [r["seconds"] for r in node1["restore"]["s3"]]
    froms = {k: "/".join(sorted({r["tier"] for r in v})) for k, v in node1["restore"].items()}
    print(f"{'node 1 restores from':<32}{'seconds (median, min-max)':>28}{'GiB/s':>8}")
    for name, xs in (("memory", own), ("peer", peer), ("s3", s3)):
        print(f"{name + ' (' + froms[name] + ')':<32}{spread(xs):>28}"
              f"{gib / statistics.median(xs):>8.2f}")  # fmt: skip
    speedup = statistics.median(s3) / statistics.median(peer)
    worst = min(s3) / max(peer)
    verdict = "MET" if worst >= 3 else ("NOT MET" if speedup < 3 else "within the noise")
    print(f"target: peer at least 3x faster than S3: {speedup:.1f}x (worst pair {worst:.1f}x), "
          f"{verdict}")  # fmt: skip
    print(f"{'compute loop with a save':<32}{'rank':>6}{'loop s (median, min-max)':>28}"
          f"{'extra s':>9}{'after loop s':>14}")  # fmt: skip
    for rank in (0, 1):
        loop, tails = rows[rank]["loop"], rows[rank]["tails"]
        base = statistics.median(loop["none"])
        for mode in ("none", "off", "on"):
            extra = statistics.median(loop[mode]) - base
            tail = f"{statistics.median(tails[mode]):.2f}" if mode in tails else "-"
            print(f"{'replication ' + mode if mode != 'none' else 'no save':<32}{rank:>6}"
                  f"{spread(loop[mode]):>28}{extra:>9.2f}{tail:>14}")  # fmt: skip
    noise = max(max(v) - min(v) for r in rows.values() for v in r["loop"].values())
    print(f"noise (widest loop spread): {noise:.2f} s")
    lost = node1["both_lost"]
    print(f"both holders lost: node 1 restored from {lost['tier']} in {lost['seconds']:.2f} s, "
          "bitwise")  # fmt: skip
    loops = {r: rows[r]["loop"] for r in rows}
    print(json.dumps({"memory": own, "peer": peer, "s3": s3, "speedup": speedup,
                      "loop": loops, "both_lost": lost}))  # fmt: skip


if __name__ == "__main__":
    main()
