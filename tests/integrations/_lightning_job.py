"""Run by test_lightning.py under torchrun: a small LightningModule on 2 ranks (DDP, gloo)
with UnbrokenCheckpointIO and its callback, reading a VolumeDataset through ub.DataLoader,
and a ModelCheckpoint of the user's (every 4 steps, save_last) whose saves go through the
plugin, so its folder stays empty.

argv: out dir, volume dir, max steps. ``FAULTS`` and the printed lines are those of
``_hf_job.py`` (see ``runs.py``).
"""

import os
import sys
import time

import lightning as L
import torch.distributed as dist

from tests.integrations.lightning_parts import Regressor, Volume
from tests.integrations.runs import act_on, digest
from unbroken.integrations.lightning import UnbrokenCheckpointIO

out, volume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = os.environ.get("FAULTS", "")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Faults(L.Callback):
    """Prints each step, and ends this rank as FAULTS says (before the step's save)."""

    def __init__(self, io: UnbrokenCheckpointIO) -> None:
        self.io, self.first = io, True

    def on_train_batch_start(self, trainer, pl_module, batch, idx):
        if self.first:
            print(f"RESTORED {rank()} {attempt} {self.io.restored_step or 0}", flush=True)
            self.first = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
        time.sleep(0.05)  # 50 ms steps: the ranks agree on a SIGTERM within a few
        print(f"STEP {rank()} {attempt} {trainer.global_step}", flush=True)
        act_on(FAULTS, attempt, rank(), trainer.global_step, self.io.manager.wait)


L.seed_everything(0, verbose=False)
model = Regressor()
model.seen = lambda step, ids: print(f"SEEN {rank()} {attempt} {step} {ids}", flush=True)
io = UnbrokenCheckpointIO(
    os.path.join(out, "ckpt"),
    staging_dir=os.path.join(out, "stage", os.environ.get("RANK", "0")),
    every_steps=1000,  # the cadence is the ModelCheckpoint's; maybe_save acts on SIGTERM
    when_busy="wait",
)
theirs = L.pytorch.callbacks.ModelCheckpoint(
    dirpath=os.path.join(out, "lightning-checkpoints"), every_n_train_steps=4, save_last=True
)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_steps=max_steps,
    plugins=[io],
    callbacks=[Faults(io), theirs, io.callback],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=out,
)
trainer.fit(
    model, datamodule=Volume(volume, workers=int(os.environ.get("WORKERS", "0"))), ckpt_path="last"
)
print(f"DONE {rank()} {attempt} {digest(model, trainer.optimizers[0])}", flush=True)
