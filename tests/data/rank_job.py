"""One rank of a data-only job, run as its own process by the cache-sharing test.

python -m tests.data.rank_job URL CACHE_DIR INDEX_DIR RANK WORLD EPOCHS BARRIER_DIR
prints one JSON line per epoch; between epochs the ranks wait for each other.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.data.conftest import decode_index
from tests.data.helpers import flatten
from unbroken.data import DataLoader, VolumeDataset


def barrier(directory: str, name: str, rank: int, world: int) -> None:
    open(os.path.join(directory, f"{name}-{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(directory, f"{name}-{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: the other ranks never arrived")
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    url, cache_dir, index_dir, rank, world, epochs, barrier_dir = argv
    rank, world = int(rank), int(world)
    ds = VolumeDataset(
        url,
        decode=decode_index,
        cache_dir=cache_dir,
        index_dir=index_dir,
        rank=rank,
        world_size=world,
        seed=21,
    )
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    for epoch in range(int(epochs)):
        before = loader.metrics.snapshot()
        samples = [s for batch in loader for s in flatten(batch)]
        after = loader.metrics.snapshot()
        delta = {k: after[k] - before[k] for k in ("hits", "misses")}
        print(json.dumps({"epoch": epoch, "samples": samples, **delta}), flush=True)
        barrier(barrier_dir, f"epoch{epoch}", rank, world)


if __name__ == "__main__":
    main(sys.argv[1:])
