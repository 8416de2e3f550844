"""Run by test_hf.py under torchrun: docs/integrations.md's accelerate recipe on 2 ranks
(DDP, gloo): the model, optimizer and scheduler prepared by accelerate, the data from
ub.DataLoader, the manager saving every 4 steps.

argv: out dir, volume dir, max steps. ``FAULTS`` and the printed lines are those of
``_hf_job.py`` (see ``runs.py``).
"""

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import unbroken as ub
from tests.integrations.runs import decode, digest, mlp, regression_loss, step_done

out, volume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = os.environ.get("FAULTS", "")


accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
set_seed(0)
net = mlp()
optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
model, optim, sched = accelerator.prepare(net, optim, sched)
loader = ub.DataLoader(ub.VolumeDataset(volume, decode=decode, seed=0), batch_size=2)
state = {
    "model": accelerator.unwrap_model(model),
    "optim": optim.optimizer,
    "sched": sched.scheduler,
    "loader": loader,
}
mgr = ub.CheckpointManager(
    os.path.join(out, "ckpt"),
    staging_dir=os.path.join(out, "stage", str(rank)),
    every_steps=4,
    when_busy="wait",
)
step = mgr.restore(state) or 0
print(f"RESTORED {rank} {attempt} {step}", flush=True)
while step < max_steps:
    for x in loader:
        step += 1
        loss = regression_loss(model, x, rank, attempt, step)
        accelerator.backward(loss)
        optim.step()
        sched.step()
        optim.zero_grad()
        step_done(FAULTS, attempt, rank, step, mgr.wait)
        mgr.maybe_save(step, state)
        if step == max_steps:
            break
mgr.save(step, state)
mgr.close()
print(f"DONE {rank} {attempt} {digest(net, optim.optimizer)}", flush=True)
