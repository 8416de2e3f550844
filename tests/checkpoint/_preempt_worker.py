"""Run by test_preemption.py under torchrun: a plain loop with no preemption code."""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import unbroken as ub

ckpt, stage, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)))
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = {"model": model, "optim": optim}
mgr = ub.CheckpointManager(ckpt, staging_dir=os.path.join(stage, str(rank)), every_steps=10_000)
step = mgr.restore(state) or 0
print(f"RESTORED {rank} {attempt} {step}", flush=True)
while step < steps:
    g = torch.Generator().manual_seed(step * 2 + rank)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    step += 1
    print(f"STEP {rank} {attempt} {step}", flush=True)
    if step == 1:  # the manager (and its SIGTERM handler) is in place: a test may signal
        tmp = os.path.join(out, f".pid-{rank}-{attempt}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(out, f"pid-{rank}-{attempt}"))
    time.sleep(0.02)
    mgr.maybe_save(step, state)
mgr.close()
digest = hashlib.sha256(
    b"".join(p.detach().numpy().tobytes() for p in model.parameters())
).hexdigest()
print(f"DONE {rank} {attempt} {digest}", flush=True)
dist.destroy_process_group()
