"""Run by test_worker_signals.py: a training process whose DataLoader has worker processes.

argv: volume, mode. It prints ``WORKERS pid...`` once its workers serve batches, then waits
for a line on stdin: ``next`` takes more batches and prints ``OK n``; ``exit`` ends.
mode ``ub``: ub.DataLoader (``ub-spawn``, ``ub-forkserver``: its workers started so);
``torch``: torch's DataLoader, with a CheckpointManager (its
preemption watch) in the process; ``torch-alone``: torch's DataLoader, no manager.
"""

import os
import sys
import tempfile

import psutil
import torch

import unbroken as ub


def decode(data: bytes, key: str) -> torch.Tensor:  # module level: spawn pickles it
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).float()


managers: list = []


def _is_worker(p: psutil.Process) -> bool:
    """Not multiprocessing's resource tracker, nor the forkserver (whose children are)."""
    cmd = " ".join(p.cmdline())
    return "resource_tracker" not in cmd and not (
        "forkserver" in cmd and p.ppid() == os.getpid()
    )


def main() -> None:
    volume, mode = sys.argv[1], sys.argv[2]
    if mode.startswith("ub"):  # ub, ub-spawn, ub-forkserver
        context = mode.split("-")[1] if "-" in mode else None
        loader = ub.DataLoader(
            ub.VolumeDataset(volume, decode=decode), batch_size=2, num_workers=2,
            multiprocessing_context=context,
        )  # fmt: skip
    else:
        files = sorted(os.listdir(volume))
        data = [torch.full((4,), float(i)) for i in range(len(files))]
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2)
    if mode.startswith("ub") or mode == "torch":
        root = tempfile.mkdtemp()
        managers.append(ub.CheckpointManager(f"{root}/ck", staging_dir=f"{root}/st"))

    def batches():
        while True:
            yield from loader

    it = batches()
    next(it)
    workers = [p.pid for p in psutil.Process().children(recursive=True) if _is_worker(p)]
    print("WORKERS", *workers, flush=True)
    for line in sys.stdin:
        if line.strip() == "next":
            for _ in range(8):
                next(it)
            print("OK", flush=True)
        else:
            break


if __name__ == "__main__":
    main()
