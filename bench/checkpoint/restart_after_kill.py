"""How soon torchrun restarts a job after one rank's SIGKILL: preemption on (the default)
beside preemption="off", in one run.

torchrun SIGTERMs the survivors of a crash before it restarts the group. A survivor that
took that signal for a preemption used to wait for an agreement with the dead rank (whose
orphaned DataLoader workers held its sockets open) and then for the interpreter's
teardown; the restart waited with it. Two figures per mode, from the SIGKILL:
- ``restart``: torchrun's log line that the group failed (the survivors have ended, the
  restart begins);
- ``restored``: the restarted ranks' first line (process start, rendezvous, restore).

The job is tests/checkpoint/_preempt_loader_worker.py: 2 ranks, DDP, the default
ub.DataLoader (worker processes), no preemption code of its own.

    python -m bench.checkpoint.restart_after_kill [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.common.torchrun import ROOT, torchrun_cmd, torchrun_env

JOB = ROOT / "tests" / "checkpoint" / "_preempt_loader_worker.py"
MODES = ("exit", "off")
"""preemption="exit" is the default."""


def one(work: Path, volume: Path, mode: str) -> dict[str, float | None]:
    out = work / f"{mode}-{time.monotonic_ns()}"
    out.mkdir()
    env = torchrun_env(PREEMPTION=mode)
    cmd = torchrun_cmd(JOB, str(out / "ckpt"), str(out / "stage"), str(out), "150", str(volume))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids = out / "pids-1-0"
    deadline = time.monotonic() + 180
    while not pids.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.uniform(1.0, 2.0))  # some steps in
    t0 = time.monotonic()
    os.kill(int(pids.read_text().split()[0]), signal.SIGKILL)
    proc.wait(timeout=300)
    reader.join(timeout=10)
    restart = next((t for t, s in lines if t > t0 and "failed (exitcode" in s), None)
    restored = next((t for t, s in lines if t > t0 and s.startswith("RESTORED") and " 1 " in s),
                    None)  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return {
        "restart": None if restart is None else restart - t0,
        "restored": None if restored is None else restored - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="kills per mode (default 5)")
    p.add_argument("--quick", action="store_true", help="2 kills per mode")
    a = p.parse_args()
    reps = 2 if a.quick else a.reps
    work = Path(tempfile.mkdtemp(prefix="ub-restart-"))
    volume = work / "volume"
    volume.mkdir()
    for i in range(64):
        (volume / f"{i:03d}.bin").write_bytes(bytes([i]) * 16)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(reps):  # ABAB: drift in the machine's load hits both alike
        for mode in MODES:
            runs[mode].append(one(work, volume, mode))
    shutil.rmtree(work, ignore_errors=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    summary = {}
    print(f"{'preemption':<12}{'restart s (median, min-max)':>32}{'restored s (median)':>22}")
    for mode in MODES:
        restart = [r["restart"] for r in runs[mode] if r["restart"] is not None]
        restored = [r["restored"] for r in runs[mode] if r["restored"] is not None]
        summary[mode] = {"restart": restart, "restored": restored}
        span = f"{min(restart):.2f}-{max(restart):.2f}" if restart else "n/a"
        med = f"{statistics.median(restart):.2f}" if restart else "n/a"
        med2 = f"{statistics.median(restored):.2f}" if restored else "n/a"
        label = mode + (" (default)" if mode == "exit" else "")
        print(f"{label:<12}{med + ' (' + span + ')':>32}{med2:>22}")
    if summary["exit"]["restart"] and summary["off"]["restart"]:
        gap = statistics.median(summary["exit"]["restart"]) - statistics.median(
            summary["off"]["restart"]
        )
        verdict = "MET" if gap <= 0.5 else "NOT MET"
        print(f"target: default within 0.5 s of off: {gap:+.2f} s, {verdict}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
