"""A small training job for the goodput tests: a real CheckpointManager and DataLoader,
nothing in the loop about goodput. ``--crash-at N`` SIGKILLs itself after step N's save
committed (in the first attempt only, under torchrun); ``--crash-at 0,20``: the first
attempt at once after restore, before its first step ends, the second after step 20.
``--crash-rank R``: only rank R kills itself. ``--term-at N``: SIGTERM (a preemption)
after step N, in the first attempt. One process or several ranks (torchrun,
gloo)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import unbroken as ub


def decode(data: bytes, path: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[:16].ljust(16, b"\0")), dtype=torch.uint8).float()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--staging", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--crash-at", default="", help="per attempt: the step to crash after")
    p.add_argument("--crash-rank", type=int, default=None, help="the rank that crashes")
    p.add_argument("--term-at", type=int, default=None)
    p.add_argument("--step-seconds", type=float, default=0.01)
    args = p.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crashes = [int(c) for c in args.crash_at.split(",") if c]
    rank = int(os.environ.get("RANK", "0"))
    crash_at = crashes[attempt] if attempt < len(crashes) else None
    if args.crash_rank is not None and rank != args.crash_rank:
        crash_at = None
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = ub.VolumeDataset(args.data, decode=decode, cache_dir=os.path.join(args.staging, "c"))
    loader = ub.DataLoader(ds, batch_size=4, num_workers=0)
    mgr = ub.CheckpointManager(  # "wait": a loaded machine must not skip the save a
        args.url, staging_dir=args.staging, every_steps=args.every, when_busy="wait"
    )  # crash's restore is counted from (step 20 skipped -> restored at 10: 15 wasted)
    state = {"model": model, "optim": optim, "loader": loader}
    step = mgr.restore(state) or 0
    if crash_at == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # at its first step: nothing flushed by then
    while step < args.steps:
        for x in loader:
            loss = model(x).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            time.sleep(args.step_seconds)
            step += 1
            mgr.maybe_save(step, state)
            if step == crash_at:
                mgr.wait()  # the step's save committed: the restart resumes there
                time.sleep(1.5)  # the local copy of the event log is appended every second
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.term_at and attempt == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # the next maybe_save saves and exits
            if step >= args.steps:
                break
    mgr.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
