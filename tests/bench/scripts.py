"""Run a script of bench/ as a user would: a fresh interpreter, the repo's src on the path."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_bench_script(name: str, *args: str, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of ``bench/<name> args``; fails the test on a nonzero exit."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr
