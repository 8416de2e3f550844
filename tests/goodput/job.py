"""A small training job for the goodput tests: a real CheckpointManager and DataLoader,
nothing in the loop about goodput. ``--crash-at N`` SIGKILLs itself after step N (in the
first attempt only, under torchrun). One process or several ranks (torchrun, gloo)."""

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
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--step-seconds", type=float, default=0.01)
    args = p.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = ub.VolumeDataset(args.data, decode=decode, cache_dir=os.path.join(args.staging, "c"))
    loader = ub.DataLoader(ds, batch_size=4, num_workers=0)
    mgr = ub.CheckpointManager(args.url, staging_dir=args.staging, every_steps=args.every)
    state = {"model": model, "optim": optim, "loader": loader}
    step = mgr.restore(state) or 0
    while step < args.steps:
        for x in loader:
            loss = model(x).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            time.sleep(args.step_seconds)
            step += 1
            mgr.maybe_save(step, state)
            if step == args.crash_at and first_attempt:
                mgr.wait()  # step 20 committed: the restart resumes there
                time.sleep(1.5)  # the local copy of the event log is appended every second
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
    mgr.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
