"""Run by test_lightning.py under torchrun: a Fabric loop on 2 ranks (DDP, gloo) whose
``fabric.save``/``fabric.load`` go through UnbrokenCheckpointIO (``io.attach(fabric)``),
reading a VolumeDataset through ub.DataLoader: ``fabric.save`` every 4 steps, and
``io.maybe_save`` each step for the SIGTERM.

argv: out dir, volume dir, max steps. ``FAULTS`` and the printed lines are those of
``_hf_job.py`` (see ``runs.py``).
"""

import os
import sys

import lightning as L
import torch
import torch.distributed as dist

import unbroken as ub
from tests.integrations.runs import decode, digest, mlp, regression_loss, step_done
from unbroken.integrations.lightning import UnbrokenCheckpointIO

out, volume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = os.environ.get("FAULTS", "")

io = UnbrokenCheckpointIO(
    os.path.join(out, "ckpt"),
    staging_dir=os.path.join(out, "stage", os.environ.get("RANK", "0")),
    every_steps=1000,  # the cadence is fabric.save's; maybe_save acts on SIGTERM
    when_busy="wait",
)
fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
fabric.launch()
io.attach(fabric)
fabric.seed_everything(0, verbose=False)
rank = dist.get_rank()

net = mlp()
optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
model, optim = fabric.setup(net, optim)
loader = ub.DataLoader(ub.VolumeDataset(volume, decode=decode, seed=0), batch_size=2)
state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "step": 0}
last = io.last_checkpoint()
if last is not None:
    fabric.load(last, state)
print(f"RESTORED {rank} {attempt} {state['step']}", flush=True)

step = state["step"]
while step < max_steps:
    for x in loader:
        step += 1
        loss = regression_loss(model, x, rank, attempt, step)
        fabric.backward(loss)
        optim.step()
        optim.zero_grad()
        sched.step()
        step_done(FAULTS, attempt, rank, step, io.manager.wait)
        state["step"] = step
        io.maybe_save(step, lambda: state)
        if step % 4 == 0 or step == max_steps:
            fabric.save(os.path.join(out, "fabric-checkpoints", f"step-{step}.ckpt"), state)
        if step == max_steps:
            break
io.teardown()
print(f"DONE {rank} {attempt} {digest(net, optim.optimizer)}", flush=True)
