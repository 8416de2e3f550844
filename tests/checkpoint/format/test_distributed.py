"""Two real ranks (gloo) save with TierWriter; load resharded on 2 ranks and on 1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.format_dist_worker import STEP, full
from unbroken import open_store
from unbroken.checkpoint.catalog import list_checkpoints, verify_checkpoint
from unbroken.checkpoint.format.dcp_json import metadata_from_json
from unbroken.checkpoint.format.dcp_load import load_state_dict
from unbroken.checkpoint.format.manifest import read_manifest
from unbroken.checkpoint.format.reader import TierReader

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(root, world: int = 2) -> None:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.format_dist_worker", str(root)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append((p.returncode, out))
    for rank, (rc, out) in enumerate(outputs):
        assert rc == 0, f"rank {rank} failed:\n{out[-4000:]}"


def test_two_ranks_save_then_load_resharded_and_on_one_rank(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(root)  # each rank also reloads with Shard(1) and checks the full tensor

    records = json.loads((root / "records.json").read_text())
    assert {n for n, _, _ in records[0]} == {"__0_0.distcp", ".metadata", "metadata.json"}
    assert {n for n, _, _ in records[1]} == {"__1_0.distcp"}

    store = open_store(root)
    (info,) = list_checkpoints(store)
    assert info.committed and info.world_size == 2
    assert verify_checkpoint(store, STEP, deep=True) == []

    manifest = read_manifest(store, STEP)
    md = metadata_from_json((root / f"step-{STEP:012d}" / "metadata.json").read_bytes(), where="m")
    files_of = {}
    for idx, loc in md.storage_data.items():
        files_of.setdefault(idx.fqn, []).append(loc.relative_path)
    assert sorted(files_of["sharded"]) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(files_of["replicated"]) == 1  # deduplicated: written by one rank only

    target = {"sharded": torch.zeros(8, 6), "replicated": torch.zeros(5), "meta": {"epoch": 0}}
    load_state_dict(target, TierReader(store, STEP, manifest))
    assert torch.equal(target["sharded"], full())
    assert torch.equal(target["replicated"], torch.arange(5.0))
    assert target["meta"] == {"epoch": 3}
