"""End to end: the README's main job, small. A rank killed mid-run under
``torchrun --max-restarts 1`` resumes from the newest committed checkpoint and ends
bit-identical to a run without the crash (data order, augmentations, dropout, weights)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_demo_crash_and_resume_is_bit_identical():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py"),
         "--steps", "40", "--crash-at", "27", "--files", "256"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "final weights bit-identical: True" in out.stdout
    assert "losses identical at every step after resume: True" in out.stdout
    assert "resumed from step 20 (attempt 1)" in out.stdout
