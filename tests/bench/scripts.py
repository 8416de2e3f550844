"""Run a benchmark of bench/ as a user would: a fresh interpreter, ``python -m`` from the root."""

from __future__ import annotations

import subprocess
import sys

from bench.common.paths import ROOT, child_env, module_argv


def run_bench_script(module: str, *args: str, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of ``python -m <module> args``; fails the test on a nonzero exit."""
    proc = subprocess.run(
        module_argv(module, *args, python=sys.executable),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr
