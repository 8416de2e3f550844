"""One rank of a gloo job whose ranks list a volume apart: run by test_distributed.

Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (as torchrun sets them).
``python -m tests.data.listing_job URL WORK apart``: each rank has a cache of its own (a
node each); rank 1 lists only after rank 0 has, and after a file landed in the volume.
``copies``: each rank reads its own copy of the volume (other modification times).
It serves one epoch and prints one JSON line: the files it served, its index's length,
the warnings it saw. ``alone``: only rank 0 makes the dataset (and says how that ended).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from datetime import timedelta

import torch.distributed as dist

from tests.data.conftest import decode_index
from unbroken import open_store
from unbroken.data import DataLoader, VolumeDataset, index_agreement


def main(url: str, work: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if mode == "alone":  # not the hour a slow node's listing may take
        index_agreement.AGREE_TIMEOUT_SECONDS = 5
    rank = dist.get_rank()
    cache = os.path.join(work, f"cache-{rank}")
    out: dict = {"rank": rank}
    if mode == "alone":
        if rank == 0:
            try:
                VolumeDataset(url, decode=decode_index, cache_dir=cache)
                out["error"] = None
            except RuntimeError as e:
                out["error"] = str(e)
            open(os.path.join(work, "done"), "w").close()
        deadline = time.monotonic() + 150  # rank 0's wait ended by then, or the test did
        while not os.path.exists(os.path.join(work, "done")) and time.monotonic() < deadline:
            time.sleep(0.1)
        print(json.dumps(out), flush=True)
        return
    if mode == "copies":  # a copy of the volume on each node's disk: other mtimes
        local = os.path.join(work, f"copy-{rank}")
        shutil.copytree(url, local)
        for folder, _, names in os.walk(local):
            for name in names:
                os.utime(os.path.join(folder, name), (1e9 + rank, 1e9 + rank))
        url = local
    if rank == 1 and mode == "apart":  # a node that lists later, after a file landed
        listed = os.path.join(work, "cache-0", "index")
        while not (os.path.isdir(listed) and any(n.endswith(".json") for n in os.listdir(listed))):
            time.sleep(0.05)
        open_store(url).write_bytes("d0/s9999.txt", b"9999")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ds = VolumeDataset(url, decode=decode_index, cache_dir=cache, shuffle=False)
    served = [int(i) for batch in DataLoader(ds, batch_size=2) for i in batch]
    out.update(files=len(ds), served=served, warnings=[str(w.message) for w in seen])
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
