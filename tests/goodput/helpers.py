"""What the goodput tests share: a small volume, a decode, a loop with nothing about
goodput in it, the environment for subprocesses."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

import unbroken as ub

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("job.py")


def make_volume(path: Path, n: int = 32) -> str:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"f{i:03d}.bin").write_bytes(os.urandom(64))
    return str(path)


def decode(data: bytes, path: str) -> torch.Tensor:
    return torch.tensor(list(data[:16]), dtype=torch.float32)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    e["OMP_NUM_THREADS"] = "1"
    return e


def train(tmp_path: Path, url: str, *, every_steps: int, step_seconds: float = 0.0) -> None:
    """One epoch (8 steps of 4 files) of an ordinary loop, in this process."""
    data = make_volume(tmp_path / "data")
    model = nn.Linear(16, 2)
    optim = torch.optim.AdamW(model.parameters())
    loader = ub.DataLoader(
        ub.VolumeDataset(data, decode=decode, cache_dir=str(tmp_path / "cache")),
        batch_size=4,
        num_workers=0,
    )
    state = {"model": model, "optim": optim, "loader": loader}
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st", every_steps=every_steps) as mgr:
        step = mgr.restore(state) or 0
        for x in loader:
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
            time.sleep(step_seconds)
            step += 1
            mgr.maybe_save(step, state)


def goodput_json(url: str, *args: str) -> dict:
    """``unbroken goodput URL --json ARGS`` in a process of its own, as a user runs it."""
    import json
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "goodput", url, "--json", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
