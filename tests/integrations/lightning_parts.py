"""The LightningModule and data of the Lightning tests (in-process and under torchrun)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

import unbroken as ub
from tests.integrations.runs import decode


class Regressor(L.LightningModule):
    """A small MLP with dropout (the RNG matters), AdamW and a per-step StepLR.

    ``seen(step, ids)`` is called with each batch's sample ids (their first byte)."""

    def __init__(self, width: int = 32, lr: float = 1e-2, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen: Callable[[int, list[int]], None] = lambda step, ids: None
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 1)
        )

    def training_step(self, x, idx):
        self.seen(self.trainer.global_step + 1, [int(i) for i in x[:, 0].tolist()])
        x = x / 255
        return (self.net(x).squeeze(1) - x.mean(1)).square().mean()

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Volume(L.LightningDataModule):
    """The loader is made in train_dataloader(): Lightning joins the process group in
    fit(), and a VolumeDataset takes its rank and world size from it."""

    def __init__(self, volume: str, batch_size: int = 2, workers: int = 0) -> None:
        super().__init__()
        self.volume, self.batch_size, self.workers = volume, batch_size, workers

    def train_dataloader(self):
        dataset = ub.VolumeDataset(self.volume, decode=decode, seed=0)
        return ub.DataLoader(dataset, batch_size=self.batch_size, num_workers=self.workers)
