"""A Lightning job that survives crashes and preemption: a plugin and its callback added.

    python examples/lightning_trainer.py --make-data /data/tokens   # a toy token volume
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/lightning_trainer.py --data /data/tokens --checkpoints s3://bucket/lit-1

A small next-token model trains on a directory of raw token files through
``ub.DataLoader`` (made in ``train_dataloader()``, once Lightning joined the process
group; Lightning saves its exact position). ``UnbrokenCheckpointIO`` writes every
checkpoint through unbroken (asynchronous, committed, no pickle), its callback saves
every ``every_steps`` and on SIGTERM, and ``fit(ckpt_path="last")`` resumes the newest
committed step after a restart. Strategies: one device or DDP.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import unbroken as ub
from unbroken.integrations.lightning import UnbrokenCheckpointIO

CONTEXT, VOCAB = 64, 256


def decode(data: bytes, key: str) -> torch.Tensor:
    """A file of little-endian uint16 token ids -> one training sequence."""
    return torch.from_numpy(np.frombuffer(data, dtype="<u2").astype(np.int64))


def make_data(root: str, files: int = 512) -> None:
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        tokens = rng.integers(0, VOCAB, CONTEXT, dtype="<u2")
        with open(os.path.join(root, f"{i:05d}.bin"), "wb") as f:
            f.write(tokens.tobytes())


class NextToken(L.LightningModule):
    def __init__(self, width: int = 128, lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain values only: unbroken stores no pickles
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.GRU(width, width, batch_first=True)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(width, VOCAB))

    def training_step(self, tokens: torch.Tensor, idx: int) -> torch.Tensor:
        hidden, _ = self.mix(self.embed(tokens[:, :-1]))
        loss = F.cross_entropy(self.head(hidden).flatten(0, 1), tokens[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Tokens(L.LightningDataModule):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def train_dataloader(self) -> ub.DataLoader:
        return ub.DataLoader(ub.VolumeDataset(self.url, decode=decode, seed=0), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="URL of the token volume (a path, s3://...)")
    parser.add_argument("--checkpoints", help="durable checkpoint URL (a path, s3://...)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--make-data", metavar="DIR", help="write a toy volume there, exit")
    args = parser.parse_args()
    if args.make_data:
        return make_data(args.make_data)
    if not (args.data and args.checkpoints):
        parser.error("--data and --checkpoints are required")
    L.seed_everything(0)
    ckpt = UnbrokenCheckpointIO(args.checkpoints, every_steps=20)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        max_steps=args.steps,
        devices=world if not torch.cuda.is_available() else "auto",
        strategy="ddp" if world > 1 else "auto",
        plugins=[ckpt],
        callbacks=[ckpt.callback],
        logger=False,
    )
    trainer.fit(NextToken(), datamodule=Tokens(args.data), ckpt_path="last")


if __name__ == "__main__":
    main()
