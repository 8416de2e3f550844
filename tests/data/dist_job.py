"""One rank of a gloo job that trains on nothing but the data: run by test_distributed.

Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (as torchrun sets them).
python -m tests.data.dist_job URL CACHE_DIR STOP_AFTER [STATE_JSON] -> one JSON line

Rank and world size come from torch.distributed (VolumeDataset is given neither);
every step all-reduces the batch size, so ranks out of lockstep would hang or differ.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.data.conftest import decode_augmented
from tests.data.helpers import flatten
from unbroken.data import DataLoader, VolumeDataset


def main(argv: list[str]) -> None:
    url, cache_dir, stop_after = argv[:3]
    dist.init_process_group("gloo")
    ds = VolumeDataset(url, decode=decode_augmented, cache_dir=cache_dir, seed=13)
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    if len(argv) > 3:
        loader.load_state_dict(json.loads(argv[3]))
    samples = []
    for step, batch in enumerate(loader, start=1):
        size = torch.tensor([len(batch[0])])
        dist.all_reduce(size)
        assert size.item() == 2 * dist.get_world_size(), size
        samples += flatten(batch)
        if step == int(stop_after):
            break
    out = {"rank": dist.get_rank(), "world": ds.world_size, "samples": samples}
    print(json.dumps({**out, "state": loader.state_dict()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
