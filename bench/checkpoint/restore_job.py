"""One rank of bench/checkpoint/restore_after_crash.py's job (run under torchrun --max-restarts 1).

Attempt 0 trains two steps of a DDP model with Adam, commits step 2 and SIGKILLs rank 1;
torchrun ends rank 0 and restarts both. Attempt 1 restores, then copies the same bytes
between two buffers already in memory (the floor), and prints one JSON line per rank.

    bench/checkpoint/restore_job.py URL STAGING MIB TIER   TIER: memory | disk
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unbroken as ub
from unbroken.checkpoint.state_dicts import collect, state_bytes


def model(params_mib: int) -> nn.Module:
    width = 2048
    layers = max(1, (params_mib << 20) // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def memcpy_seconds(nbytes: int) -> tuple[float, float]:
    """The same bytes copied between two buffers already in memory (best of 3), and into
    memory the process never touched before (first touch: what a restarted process pays
    for the optimizer state it allocates as it restores; best of 2)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    warm = cold = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        warm = min(warm, time.perf_counter() - t)
    del dst
    for _ in range(2):
        fresh = torch.empty_like(src)
        t = time.perf_counter()
        fresh.copy_(src)
        cold = min(cold, time.perf_counter() - t)
        del fresh
    return warm, cold


def main(url: str, staging: str, params_mib: int, tier: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    net = DDP(model(params_mib))
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    state = {"model": net, "optim": optim}
    mgr = ub.CheckpointManager(
        url, staging_dir=staging, every_steps=2, when_busy="wait",
        memory_tier=None if tier == "memory" else False, goodput=False, mlflow=False,
    )  # fmt: skip
    if attempt == 0:
        for step in (1, 2):
            x = torch.randn(4, 2048)
            net(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            mgr.maybe_save(step, state)
        mgr.wait()
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # torchrun ends this rank
        return
    began = time.perf_counter()
    step = mgr.restore(state)
    seconds = time.perf_counter() - began
    nbytes = state_bytes(collect(state))
    floor, first_touch = memcpy_seconds(nbytes)
    restored = mgr.last_restore
    print(
        "RESULT " + json.dumps({
            "rank": rank, "step": step, "tier": restored.tier, "seconds": seconds,
            "inside": restored.seconds, "bytes": nbytes, "memcpy": floor,
            "first_touch": first_touch,
        }),
        flush=True,
    )  # fmt: skip
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
