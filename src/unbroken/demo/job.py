"""The demo's training job, written the way a user would: unbroken data + checkpoints.

Run by ``unbroken demo`` under torchrun (any number of ranks, gloo on CPU, NCCL where
GPUs exist):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        -m unbroken.demo.job --data DATA_URL --checkpoints CKPT_URL --steps 120

On (re)start it resumes from the newest committed checkpoint by itself: model,
optimizer, LR schedule, data position and every RNG. Nothing in the loop is about
failures: ``maybe_save`` is the only call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

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


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_digest(optim: torch.optim.Optimizer) -> str:
    state = optim.state_dict()["state"]
    return digest([v for k in sorted(state) for _, v in sorted(state[k].items())
                   if isinstance(v, torch.Tensor)])  # fmt: skip


def report_progress(path: str | None, attempt: int, step: int, restored: Any = None) -> None:
    """Rank 0 tells the demo's driver where it is (atomically, for a reader polling it),
    and where this attempt's restore came from and how long it took."""
    if path is None:
        return
    tmp = f"{path}.tmp"
    came = "" if restored is None else f" {restored.tier} {restored.seconds:.3f}"
    with open(tmp, "w") as f:
        f.write(f"{attempt} {step}{came}")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True,
                        help="URL of the directory of raw files (required)")
    parser.add_argument("--checkpoints", required=True,
                        help="durable checkpoint URL (required)")
    parser.add_argument("--staging-dir", default=None,
                        help="the local tier (default: $UNBROKEN_STAGING_DIR or the temp dir)")
    parser.add_argument("--steps", type=int, default=120, help="(default: %(default)s)")
    parser.add_argument("--every-steps", type=int, default=10,
                        help="save every N steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="per rank (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="DataLoader workers (default: %(default)s)")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="extra seconds per step, standing in for a larger model "
                        "(default: %(default)s)")
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None,
                        help="rank 0 writes a JSON summary here (default: none)")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
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
    mgr = ub.CheckpointManager(args.checkpoints, staging_dir=args.staging_dir,
                               every_steps=args.every_steps, keep_last=2)  # fmt: skip

    step = mgr.restore(state) or 0
    resumed_from = step
    began = time.perf_counter()
    losses: dict[int, float] = {}
    while step < args.steps:
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optim.zero_grad()
            loss.backward()
            if args.step_seconds:
                time.sleep(args.step_seconds)
            optim.step()
            sched.step()
            step += 1
            losses[step] = loss.item()
            if rank == 0:
                report_progress(args.progress, attempt, step, mgr.last_restore)
            mgr.maybe_save(step, state)
            if step >= args.steps:
                break
    mgr.save(step, state)
    mgr.close()

    if rank == 0:
        stats = mgr.stats
        metrics = loader.metrics
        summary = {
            "attempt": attempt,
            "resumed_from": resumed_from,
            "steps": step,
            "train_seconds": time.perf_counter() - began,
            "losses": losses,
            "weights": digest(list(model.parameters())),
            "optimizer": optimizer_digest(optim),
            "saves_committed": stats.committed,
            "saves_skipped_busy": stats.skipped_busy,
            "seconds_blocked_per_save": stats.seconds_blocked / max(stats.started, 1),
            "last_commit_seconds": stats.last_commit_seconds,
            "bytes_committed": stats.bytes_committed,
            "restore": None if mgr.last_restore is None else {
                "step": mgr.last_restore.step,
                "tier": mgr.last_restore.tier,
                "seconds": mgr.last_restore.seconds,
            },
            "fetch_seconds": metrics.fetch_seconds,
            "batches": metrics.batches,
            "cache_hits": metrics.hits,
            "cache_misses": metrics.misses,
            "bytes_fetched": metrics.bytes_fetched,
        }
        if args.result:
            with open(args.result, "w") as f:
                json.dump(summary, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
