"""A real training script, written the way a user would: unbroken data + checkpoints.

Run it under torchrun (any number of ranks, gloo on CPU, NCCL where GPUs exist):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 \\
        examples/train.py --data DATA_URL --checkpoints CKPT_URL --steps 120

On (re)start it resumes from the newest committed checkpoint by itself: model,
optimizer, LR schedule, data position and every RNG. ``--crash-at N`` kills one rank at
step N on the first attempt only (after letting the in-flight save commit, so the run is
reproducible), to show recovery.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import unbroken as ub

IMAGE_SHAPE = (3, 16, 16)


def decode(data: bytes, path: str) -> tuple[torch.Tensor, int]:
    """A raw uint8 image plus a label in the file name; a random flip as augmentation."""
    image = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).reshape(IMAGE_SHAPE).copy())
    image = image.float().div_(255)
    if torch.rand(()) < 0.5:  # seeded per sample by VolumeDataset: identical after resume
        image = image.flip(-1)
    label = int(os.path.basename(path).split("-")[0])
    return image, label


class SmallNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)  # uses the training loop's RNG: restored on resume
        self.head = nn.Linear(16 * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(self.drop(x.flatten(1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="URL of the directory of raw files")
    parser.add_argument("--checkpoints", required=True, help="durable checkpoint URL")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--result", default=None, help="rank 0 writes a JSON summary here")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)

    model = SmallNet()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    dataset = ub.VolumeDataset(args.data, decode=decode, shuffle=True, seed=7)
    loader = ub.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader}
    mgr = ub.CheckpointManager(args.checkpoints, every_steps=args.every_steps, keep_last=2)

    start = time.perf_counter()
    step = mgr.restore(state) or 0
    resumed_from = step
    losses: dict[int, float] = {}
    while step < args.steps:
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            losses[step] = loss.item()
            if step == args.crash_at and attempt == 0:
                # Let the in-flight save commit first, so the demo is deterministic.
                mgr.wait()
                if rank == dist_last_rank(distributed):
                    print(f"[rank {rank}] simulated node failure at step {step}", flush=True)
                    os._exit(17)
            mgr.maybe_save(step, state)
            if step >= args.steps:
                break
    mgr.save(step, state)
    mgr.close()
    elapsed = time.perf_counter() - start

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    if rank == 0:
        summary = {
            "attempt": attempt,
            "resumed_from": resumed_from,
            "steps": step,
            "losses": losses,
            "weights_sha256": digest,
            "seconds": elapsed,
            "fetch_seconds": loader.metrics.fetch_seconds,
            "checkpoints": [c.step for c in mgr.checkpoints() if c.committed],
        }
        print(
            f"[rank 0] attempt {attempt}: steps {resumed_from}->{step}, "
            f"final loss {losses.get(step, float('nan')):.4f}, weights {digest}",
            flush=True,
        )
        if args.result:
            with open(args.result, "w") as f:
                json.dump(summary, f)
    if distributed:
        dist.destroy_process_group()


def dist_last_rank(distributed: bool) -> int:
    return dist.get_world_size() - 1 if distributed else 0


if __name__ == "__main__":
    main()
