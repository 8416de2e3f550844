"""Train a small CNN with DDP on a directory of JPEGs; it survives any crash by itself.

    python examples/train_classifier.py --make-data /data/jpegs     # a toy data set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/train_classifier.py --data /data/jpegs --checkpoints s3://bucket/run-1 \\
        --staging-dir /local/nvme/staging --steps 200

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` keeps torchrun's restarts from hanging (see the
README). Runs unchanged on CPUs (gloo) and on GPUs (NCCL, one GPU per rank). On every
(re)start it resumes from the newest committed checkpoint: weights, optimizer, LR
schedule, data position and every RNG, so a run that crashed ends bit-identical to one
that did not (on 2 ranks; DDP on more sums its first iteration in another order:
docs/concepts.md, "Exact resume"). File names carry the label: ``<label>-<anything>.jpg``.
"""

from __future__ import annotations

import argparse
import io
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn

import unbroken as ub
from common import RunRecord, init_distributed, options_for, parse_args

CROP = 28  # random 28x28 crops of 32x32 images


def decode(data: bytes, path: str) -> tuple[torch.Tensor, int, int]:
    """JPEG bytes -> (augmented image, label, sample id), both read from the file name.

    unbroken seeds torch's RNG per sample around this call, so a sample gets the same
    crop and flip however often the run restarts."""
    image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    x = torch.from_numpy(image.copy()).permute(2, 0, 1).float().div_(255)
    top, left = torch.randint(0, x.shape[1] - CROP + 1, (2,)).tolist()
    x = x[:, top : top + CROP, left : left + CROP]
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    label, sample_id = os.path.splitext(os.path.basename(path))[0].split("-")
    return x, int(label), int(sample_id)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.drop = nn.Dropout(0.25)  # draws from the loop's RNG: restored on resume
        self.head = nn.Linear(64 * (CROP // 4) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x).flatten(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=32, help="per rank (default: %(default)s)"
    )
    args = parse_args(parser)
    if args.make_data:
        return make_data(args.make_data)

    device = init_distributed()  # NCCL and a GPU per rank where there are GPUs, else gloo
    rank, cuda = dist.get_rank(), device.type == "cuda"
    torch.manual_seed(0)  # the same initial weights on every rank

    model = nn.parallel.DistributedDataParallel(
        SmallCNN().to(device), device_ids=[device.index] if cuda else None
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    # Each rank reads its share of every global batch; the local cache keeps fetched files.
    dataset = ub.VolumeDataset(
        args.data,
        decode=decode,
        seed=1,
        storage_options=options_for(args.data, args.storage_options),
    )
    loader = ub.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)

    # Everything that shapes training goes into the checkpoint. "progress" is a plain
    # value (JSON): the digest of every sample trained on so far, for the tests.
    state = {
        "model": model, "optim": optim, "sched": sched, "loader": loader,
        "progress": {"samples_sha256": ""},
    }  # fmt: skip
    mgr = ub.CheckpointManager(
        args.checkpoints,
        staging_dir=args.staging_dir,
        every_steps=args.every_steps,
        keep_last=2,
        storage_options=options_for(args.checkpoints, args.storage_options),
    )
    step = mgr.restore(state) or 0  # the newest committed checkpoint; None on a first start
    record = RunRecord(device, step, mgr.last_restore)  # says where it started from
    while step < args.steps:
        for images, labels, ids in loader:  # one epoch; resumes mid-epoch after a restore
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            record.add(state["progress"], step, ids, loss.item())
            mgr.maybe_save(step, state)  # returns at once; the save runs in the background
            if rank == 0 and step % args.log_every == 0:
                print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    mgr.save(step, state)  # a rerun of a finished job restores this and does nothing
    mgr.close()  # waits for the commit

    record.write(
        args.result, progress=state["progress"], weights=model.module.state_dict().values(),
        optim=optim,
    )  # fmt: skip
    print(f"[rank {rank}] done at step {step}", flush=True)
    dist.destroy_process_group()


def make_data(root: str, files: int = 2048) -> None:
    """32x32 JPEGs of 10 classes, each class a colour tint plus noise (learnable)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    tints = rng.integers(40, 216, size=(10, 3))
    for i in range(files):
        label = int(rng.integers(10))
        noise = rng.normal(0, 40, size=(32, 32, 3))
        pixels = np.clip(tints[label] + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, f"{label}-{i:05d}.jpg"), quality=90)
    print(f"wrote {files} JPEGs to {root}")


if __name__ == "__main__":
    main()
