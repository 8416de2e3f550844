"""Run by test_worker_signals.py: a training process whose DataLoader has worker processes.

argv: volume, mode. It prints ``WORKERS pid...`` once its workers serve batches, then waits
for a line on stdin: ``next`` takes more batches and prints ``OK n``; ``exit`` ends.
mode ``ub``: ub.DataLoader; ``torch``: torch's DataLoader, with a CheckpointManager (its
preemption watch) in the process; ``torch-alone``: torch's DataLoader, no manager.
"""

import os
import sys
import tempfile

import psutil
import torch

import unbroken as ub

volume, mode = sys.argv[1], sys.argv[2]


def decode(data: bytes, key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).float()


if mode == "ub":
    loader = ub.DataLoader(ub.VolumeDataset(volume, decode=decode), batch_size=2, num_workers=2)
else:
    files = sorted(os.listdir(volume))
    data = [torch.full((4,), float(i)) for i in range(len(files))]
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2)
if mode in ("ub", "torch"):
    root = tempfile.mkdtemp()
    mgr = ub.CheckpointManager(f"{root}/ck", staging_dir=f"{root}/st")


def batches():
    while True:
        yield from loader


it = batches()
next(it)
workers = [c.pid for c in psutil.Process().children()]
print("WORKERS", *workers, flush=True)
for line in sys.stdin:
    if line.strip() == "next":
        for _ in range(8):
            next(it)
        print("OK", flush=True)
    else:
        break
