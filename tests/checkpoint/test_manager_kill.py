"""kill -9 at random moments during saves: restore always yields a whole committed step.

A 2-rank job (DDP, torchrun) saves every step a state in which every tensor holds the
step number; the test kills the whole job with SIGKILL at a random moment, then restores
in this process and checks that every restored value equals the restored step. The next
trial resumes the same job from there, so restores after kills are exercised too.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import unbroken as ub
from unbroken.checkpoint.catalog import verify_checkpoint

from .distributed import ROOT, SCENARIOS, free_port, kill_tree, rank_env

pytestmark = pytest.mark.multiprocess


def churn_state() -> dict:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    return {"model": model, "extra": torch.zeros(300_000), "step": 0}


def start_job(url: str, staging: str) -> tuple[subprocess.Popen, threading.Event, list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        str(SCENARIOS),
        "churn",
        "--url",
        url,
        "--staging",
        staging,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    started, lines = threading.Event(), []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "churning from step" in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, started, lines


def check_restorable(url: str, staging: str) -> int | None:
    state = churn_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = ub.CheckpointManager(url, staging_dir=staging)
        step = mgr.restore(state)
        committed = [c.step for c in mgr.checkpoints() if c.committed]
        mgr.close()
    if step is None:
        assert committed == [], committed
        return None
    assert step == max(committed), (step, committed)
    assert state["step"] == step
    for name, p in state["model"].state_dict().items():
        assert torch.all(p == step), f"{name} is torn: not all {step} (restored step {step})"
    assert torch.all(state["extra"] == step)
    store = ub.open_store(url)
    for c in committed:  # every committed checkpoint is whole, byte for byte
        assert verify_checkpoint(store, c, deep=True) == [], c
    return step


def run_trials(tmp_path, trials: int, seed: int) -> list[int | None]:
    rng = random.Random(seed)
    url, staging = str(tmp_path / "durable"), str(tmp_path / "staging")
    restored: list[int | None] = []
    for trial in range(trials):
        proc, started, lines = start_job(url, staging)
        try:
            assert started.wait(90), "job did not start:\n" + "".join(lines)
            time.sleep(rng.uniform(0.0, 2.5))
        finally:
            kill_tree(proc.pid)
            proc.wait(30)
        step = check_restorable(url, staging)
        if restored and restored[-1] is not None:
            assert step is not None and step >= restored[-1], (trial, step, restored)
        restored.append(step)
    return restored


def check_staging_tidied(url: str, staging: str, newest: int) -> None:
    """A job resumed after the kills on another cadence: its first save leaves in the
    node's tiers only its own copy (in the memory tier), whatever partial copies the
    killed saves left; its clean end removes that too."""
    import os

    from unbroken.checkpoint.format.manifest import parse_step_dir, step_dir

    def steps(path: str) -> list[str]:
        return sorted(e for e in os.listdir(path) if parse_step_dir(e) is not None)

    state = churn_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = ub.CheckpointManager(url, staging_dir=staging)
        assert mgr.restore(state) == newest
        next_step = newest + 100
        assert mgr.save(next_step, state)
        mgr.wait()
        memory = mgr.memory_tier.path
        assert steps(memory) == [step_dir(next_step)], os.listdir(memory)
        assert steps(staging) == [], os.listdir(staging)
        mgr.close()
    assert not os.path.exists(memory), os.listdir(memory)


def test_kill_during_saves_quick(tmp_path):
    restored = run_trials(tmp_path, trials=3, seed=1)
    assert restored[-1] is not None, restored
    check_staging_tidied(str(tmp_path / "durable"), str(tmp_path / "staging"), restored[-1])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_during_saves_many(tmp_path):
    restored = run_trials(tmp_path, trials=20, seed=2)
    assert sum(s is not None for s in restored) >= 15, restored
    check_staging_tidied(str(tmp_path / "durable"), str(tmp_path / "staging"), restored[-1])
