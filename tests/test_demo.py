"""End to end: `unbroken demo`, small. Ranks SIGKILLed at random moments under
``torchrun --max-restarts`` resume by themselves, and the run ends bitwise equal to one
without failures (data order, augmentations, dropout, weights, optimizer state)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_unbroken_demo_crashes_resumes_and_ends_bitwise_equal(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    plot = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli.main", "demo", "--steps", "40", "--kills", "2",
         "--files", "256", "--every-steps", "10", "--seed", "3", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bitwise equal to the reference: yes" in out.stdout, out.stdout
    assert re.search(r"2 ranks killed .*, 2 restarts", out.stdout), out.stdout
    assert "goodput" in out.stdout and "wasted" in out.stdout
    assert plot.stat().st_size > 0
    assert "Traceback" not in out.stdout + out.stderr
