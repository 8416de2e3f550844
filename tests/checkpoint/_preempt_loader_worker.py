"""Run by test_preemption.py under torchrun: a DDP job as users write it, with the default
ub.DataLoader (worker processes) and no preemption code of its own.

argv: checkpoints, staging root, out dir, steps, volume dir (``$CKPT_URL`` with
``$CKPT_OPTIONS``, JSON storage options, in place of the checkpoints path: an object
store, whose uploads go through each rank's save helper). Each rank prints
``STEP rank attempt step`` and, at the end, ``DONE rank attempt digest`` (weights and the
samples seen); ``pids-<rank>-<attempt>`` lists the rank's pid and its workers' pids once
the manager (and its SIGTERM handler) and the loader's workers are in place.
"""

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import unbroken as ub

ckpt, stage, out, volume = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]
steps = int(sys.argv[4])
preemption = os.environ.get("PREEMPTION", "exit")
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test may ask where it is
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def decode(data: bytes, key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).float()


torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.3)))
optim = torch.optim.SGD(model.parameters(), lr=0.01)
loader = ub.DataLoader(ub.VolumeDataset(volume, decode=decode, seed=0), batch_size=2)
state = {"model": model, "optim": optim, "loader": loader, "seen": []}
mgr = ub.CheckpointManager(
    os.environ.get("CKPT_URL", ckpt),
    staging_dir=os.path.join(stage, str(rank)),
    every_steps=10_000,
    preemption=preemption,
    storage_options=json.loads(os.environ.get("CKPT_OPTIONS", "null")),
)
step = mgr.restore(state) or 0
print(f"RESTORED {rank} {attempt} {step}", flush=True)
published = False
while step < steps:
    for x in loader:
        loss = model(x / 255).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        state["seen"] = [*state["seen"], int(x[0, 0])]
        print(f"STEP {rank} {attempt} {step}", flush=True)
        if not published:  # handler and workers in place: a test may signal now
            import psutil

            pids = [os.getpid(), *(c.pid for c in psutil.Process().children())]
            tmp = os.path.join(out, f".pids-{rank}-{attempt}")
            with open(tmp, "w") as f:
                f.write(" ".join(map(str, pids)))
            os.replace(tmp, os.path.join(out, f"pids-{rank}-{attempt}"))
            published = True
        time.sleep(0.02)
        mgr.maybe_save(step, state)
        if step == steps:
            break
mgr.close()
digest = hashlib.sha256(
    b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    + repr(state["seen"]).encode()
).hexdigest()
print(f"DONE {rank} {attempt} {digest}", flush=True)
dist.destroy_process_group()
