"""What the integration jobs print, read back: restores, steps, samples seen, digests.

A job (``_hf_job.py``, ``_lightning_job.py``) prints per rank ``RESTORED rank attempt
step`` once its restore ran, ``STEP rank attempt step`` before each step's save,
``SEEN rank attempt step [ids]`` for each step's batch and ``DONE rank attempt digest`` at
the end. Lines of two ranks may run into each other, so they are found anywhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Run:
    """One torchrun launch's output, parsed."""

    text: str

    def restored(self, rank: int, attempt: int) -> int:
        hits = re.findall(rf"RESTORED {rank} {attempt} (\d+)", self.text)
        assert len(hits) == 1, (rank, attempt, self.text[-5000:])
        return int(hits[0])

    def last_step(self, rank: int, attempt: int) -> int:
        hits = re.findall(rf"STEP {rank} {attempt} (\d+)", self.text)
        assert hits, (rank, attempt, self.text[-5000:])
        return int(hits[-1])

    def trajectory(self, rank: int) -> dict[int, list[int]]:
        """Step -> the sample ids of its batch, the last attempt's where steps were redone:
        the samples the final weights were trained on."""
        seen: dict[int, list[int]] = {}
        for m in re.finditer(rf"SEEN {rank} \d+ (\d+) \[([\d, ]*)\]", self.text):
            seen[int(m[1])] = [int(i) for i in m[2].split(",") if i.strip()]
        return seen

    def digests(self) -> set[str]:
        return set(re.findall(r"DONE \d+ \d+ ([0-9a-f]{64})", self.text))


FAULTS = "0:1:kill:10,1:0:term:13"
"""Attempt 0: rank 1 is SIGKILLed at step 10, once its save of step 8 is committed (saves
every 4 steps); attempt 1: rank 0 gets a SIGTERM at step 13; attempt 2 finishes."""


def check_killed_then_preempted(reference: Run, job: Run, steps: int, per_epoch: int) -> None:
    """``job`` (run with FAULTS, 2 ranks) resumed from step 8 after the kill and from the
    step the SIGTERM's save reached (none lost), and ended as ``reference``: the same
    samples at each step, each once per epoch, the same weights and optimizer state."""
    for rank in (0, 1):
        assert job.restored(rank, 0) == 0
        assert job.restored(rank, 1) == 8
        reached = job.last_step(rank, 1)
        assert 13 <= reached < steps  # the preemption's save: the step reached
        assert job.restored(rank, 2) == reached
        assert job.trajectory(rank) == reference.trajectory(rank)
    each_sample_once_per_epoch(job, 2, per_epoch, 2 * 2 * per_epoch)
    assert len(reference.digests()) == 1  # both ranks hold the same weights
    assert job.digests() == reference.digests()  # weights and Adam's moments, bitwise


def decode(data: bytes, key: str) -> torch.Tensor:
    """A toy volume's file as 16 floats (its first is the file's index)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).float()


def mlp() -> nn.Module:
    """The small MLP of the loop jobs (Fabric, accelerate); dropout on: the RNG matters."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def regression_loss(model: nn.Module, x: torch.Tensor, rank: int, attempt: int, step: int):
    """Prints the batch's ``SEEN`` line; the loss of fitting each sample's mean."""
    print(f"SEEN {rank} {attempt} {step} {[int(i) for i in x[:, 0].tolist()]}", flush=True)
    x = x / 255
    return (model(x).squeeze(1) - x.mean(1)).square().mean()


def step_done(faults: str, attempt: int, rank: int, step: int, wait: Callable[[], None]) -> None:
    """A 50 ms step (the ranks agree on a SIGTERM within a few), its ``STEP`` line, and
    ``act_on`` before the step's save."""
    time.sleep(0.05)
    print(f"STEP {rank} {attempt} {step}", flush=True)
    act_on(faults, attempt, rank, step, wait)


def launch_reference_and_faulted(launch: Callable[..., Run], tmp_path: Path, volume: Path):
    """``launch`` once uninterrupted and once with FAULTS under ``--max-restarts 2``."""
    reference = launch(tmp_path / "reference", volume, timeout=300)
    job = launch(tmp_path / "job", volume, max_restarts=2, env={"FAULTS": FAULTS}, timeout=420)
    return reference, job


def act_on(faults: str, attempt: int, rank: int, step: int, wait: Callable[[], None]) -> None:
    """End this rank as ``faults`` (``attempt:rank:kill|term:step``, comma-separated) says
    for this step: SIGKILL once ``wait()`` (the last save committed) returned, or SIGTERM."""
    for entry in filter(None, faults.split(",")):
        a, r, what, at = entry.split(":")
        if (int(a), int(r), int(at)) == (attempt, rank, step):
            if what == "kill":
                wait()  # the restart resumes from a known step
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGTERM)


def each_sample_once_per_epoch(run: Run, ranks: int, steps_per_epoch: int, files: int) -> None:
    """Every whole epoch of the final trajectory holds every file once, across ranks."""
    paths = [run.trajectory(r) for r in range(ranks)]
    last = max(paths[0])
    for start in range(1, last + 1, steps_per_epoch):
        steps = range(start, start + steps_per_epoch)
        if steps[-1] > last:
            ids = [i for p in paths for s in steps if s in p for i in p[s]]
            assert len(ids) == len(set(ids)), f"epoch from step {start}: a sample twice"
            return
        ids = sorted(i for p in paths for s in steps for i in p[s])
        assert ids == list(range(files)), f"epoch from step {start}: {ids}"


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """The weights and the optimizer's state, bitwise, in a fixed order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for name in sorted(optim.state[p]):  # a restored state may list them in another order
            h.update(optim.state[p][name].numpy().tobytes())
    return h.hexdigest()
