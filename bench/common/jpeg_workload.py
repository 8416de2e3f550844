"""The JPEG workload every data benchmark shares: the files, the decode, the clock.

Every loader compared (stock, unbroken, the peers) reads the same generated JPEGs, runs
the same :func:`decode` and is timed by the same :class:`Epoch`, so their rows differ only
in the loader.
"""

from __future__ import annotations

import io
import os
import random
import resource
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common.proc_cpu import process_cpu_seconds

CROP = 224
SIDE = 400  # 400x400, quality 88, with grain: about 100 KB per JPEG


# -- data ------------------------------------------------------------------------------


def _make_jpegs(args: tuple[str, int, int]) -> None:
    directory, start, stop = args
    rng = np.random.default_rng(start)
    for i in range(start, stop):
        path = os.path.join(directory, f"{i // 1000:03d}", f"img{i:06d}.jpg")
        if os.path.exists(path):
            continue
        low = rng.integers(0, 256, (SIDE // 8, SIDE // 8, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(low).resize((SIDE, SIDE), Image.BILINEAR))
        grain = rng.normal(0, 30, (SIDE, SIDE, 3))
        pixels = np.clip(base.astype(np.int16) + grain, 0, 255).astype(np.uint8)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        Image.fromarray(pixels).save(tmp, "JPEG", quality=88)
        os.replace(tmp, path)


def ensure_dataset(bench_dir: str, files: int, workers: int) -> tuple[str, list[str]]:
    """``files`` JPEGs under ``bench_dir`` (generated once, reused by later runs)."""
    directory = os.path.join(bench_dir, f"jpeg{SIDE}-{files}")
    os.makedirs(directory, exist_ok=True)
    step = 250
    jobs = [(directory, s, min(files, s + step)) for s in range(0, files, step)]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        list(pool.map(_make_jpegs, jobs))
    keys = [f"{i // 1000:03d}/img{i:06d}.jpg" for i in range(files)]
    return directory, keys


def decode(data: bytes, path: str) -> torch.Tensor:
    """A real decode and augmentation: JPEG -> RGB -> random crop -> random flip -> CHW."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    x = random.randint(0, img.width - CROP)
    y = random.randint(0, img.height - CROP)
    img = img.crop((x, y, x + CROP, y + CROP))
    if random.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and all its children, live or reaped."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for pid in _live_descendants(os.getpid()):
        try:
            total += process_cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            continue
    return total


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot, or None without /proc."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    total = sum(ticks[:8])  # guest time is already inside user
    return total - idle, total


def _busy_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _live_descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


class Epoch:
    """One timed pass: images, seconds, seconds to the first batch, steady rate, CPU.

    ``outside``: CPU-seconds clocks (by name) of processes in this tree that are not the
    loader's, such as an S3 server or a delay line this process started; their CPU is
    taken out of :attr:`cpu_ms` and reported per image in :attr:`outside_ms`.
    """

    def __init__(self, loader, outside: dict[str, Callable[[], float]] | None = None) -> None:
        self.images = 0
        outside = outside or {}
        outside_before = {name: clock() for name, clock in outside.items()}
        machine_before = machine_cpu_ticks()
        cpu_before = tree_cpu_seconds()
        own_before = time.process_time()
        started = time.perf_counter()
        first_at, first_images = None, 0
        for batch in loader:
            self.images += len(batch)
            if first_at is None:
                first_at, first_images = time.perf_counter(), self.images
        ended = time.perf_counter()
        tree_ms = (tree_cpu_seconds() - cpu_before) * 1000 / max(self.images, 1)
        self.own_ms = (time.process_time() - own_before) * 1000 / max(self.images, 1)
        """CPU milliseconds per image of this process alone (every thread of it, its
        in-process ``outside`` clocks included): with :attr:`cpu_ms`, how a loader's cost
        splits between the training process and its workers."""
        self.machine_busy = _busy_between(machine_before, machine_cpu_ticks())
        """Share of the whole machine's CPU busy over the pass (every job's), or None."""
        self.outside_ms = {
            name: (clock() - outside_before[name]) * 1000 / max(self.images, 1)
            for name, clock in outside.items()
        }
        """CPU milliseconds per image of each ``outside`` process."""
        self.cpu_ms = tree_ms - sum(self.outside_ms.values())
        """CPU milliseconds per image of the loader's processes (the main one and its
        workers, not ``outside``): what the load of others cannot skew."""
        self.seconds = ended - started
        self.first_batch = (first_at or ended) - started
        steady_seconds = ended - (first_at or ended)
        # worker start-up (paid by the stock loaders every epoch) is left out of the rate
        self.rate = (self.images - first_images) / steady_seconds if steady_seconds else 0.0


def upload(client: Any, bucket: str, prefix: str, root: str, keys: list[str]) -> None:
    """Put every file of the set under ``s3://bucket/prefix/`` (16 threads, boto3)."""

    def put(key: str) -> None:
        with open(os.path.join(root, key), "rb") as f:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=f.read())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))
