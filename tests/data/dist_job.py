"""One rank of a gloo job that trains on nothing but the data: run by test_distributed.

Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (as torchrun sets them).
python -m tests.data.dist_job URL CACHE_DIR LAST_EPOCH STOP_AFTER [STATE_JSON]
serves epochs until LAST_EPOCH, stopping there after STOP_AFTER steps (0: at its end),
and prints one JSON line: samples per epoch, loader metrics, final state.

Rank and world size come from torch.distributed (VolumeDataset is given neither);
every step all-reduces the batch size, so ranks out of lockstep would hang or differ.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

from tests.data.conftest import decode_augmented
from tests.data.helpers import flatten
from unbroken.data import DataLoader, VolumeDataset


def main(argv: list[str]) -> None:
    url, cache_dir, last_epoch, stop_after = argv[0], argv[1], int(argv[2]), int(argv[3])
    dist.init_process_group("gloo")
    ds = VolumeDataset(url, decode=decode_augmented, cache_dir=cache_dir, seed=13)
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    if len(argv) > 4:
        loader.load_state_dict(json.loads(argv[4]))
    samples = defaultdict(list)
    while loader.state_dict()["epoch"] <= last_epoch:
        for step, batch in enumerate(loader, start=1):
            size = torch.tensor([len(batch[0])])
            dist.all_reduce(size)
            assert size.item() == 2 * dist.get_world_size(), size
            samples[loader.epoch] += flatten(batch)
            if loader.epoch == last_epoch and step == stop_after:
                break
        if loader.epoch == last_epoch:
            break
    out = {"rank": dist.get_rank(), "world": ds.world_size, "samples": samples}
    out.update(metrics=loader.metrics.snapshot(), state=loader.state_dict())
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
