"""One rank of the 2-rank format test: save a sharded DTensor, reload it resharded.

Run by tests/checkpoint/format/test_distributed.py as real processes over gloo.
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.worker_exit import exit_after_checks
from unbroken import __version__, open_store
from unbroken.checkpoint.format.dcp_load import load_state_dict
from unbroken.checkpoint.format.manifest import FileRecord, Manifest, read_manifest, write_manifest
from unbroken.checkpoint.format.reader import TierReader
from unbroken.checkpoint.format.writer import TierWriter

warnings.filterwarnings("ignore")
STEP = 3


def full() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    store = open_store(root)
    sd = {
        "sharded": distribute_tensor(full(), mesh, [Shard(0)]),
        "replicated": torch.arange(5.0),
        "meta": {"epoch": 3},
    }
    writer = TierWriter(f"{root}/step-{STEP:012d}")
    dcp.save(sd, storage_writer=writer)
    records = [None] * world
    dist.all_gather_object(records, [(r.name, r.size, r.crc32c) for r in writer.records])
    if rank == 0:
        files = {n: FileRecord(n, s, c) for per_rank in records for n, s, c in per_rank}
        manifest = Manifest(STEP, world, files, __version__, torch.__version__, time.time(), {})
        write_manifest(store, manifest)
        with open(f"{root}/records.json", "w") as f:
            json.dump(records, f)
    dist.barrier()

    target = {
        "sharded": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
        "replicated": torch.zeros(5),
        "meta": {"epoch": 0},
    }
    load_state_dict(target, TierReader(store, STEP, read_manifest(store, STEP)))
    assert target["sharded"].to_local().shape == (8, 3)
    assert torch.equal(target["sharded"].full_tensor(), full())
    assert torch.equal(target["replicated"], torch.arange(5.0))
    assert target["meta"] == {"epoch": 3}
    dist.barrier()
    dist.destroy_process_group()
    exit_after_checks()


if __name__ == "__main__":
    main(sys.argv[1])
