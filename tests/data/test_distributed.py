"""Real ranks (gloo): rank and world from torch.distributed, lockstep, elastic resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.data.conftest import decode_augmented
from tests.data.helpers import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *args: str, job: str = "tests.data.dist_job") -> list[dict]:
    """Start ``world`` ranks of ``job``; their JSON results by rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", job, *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.multiprocess
def test_gloo_ranks_share_a_cache_and_resume_on_another_world_size(make_volume, tmp_path):
    vol = make_volume(32)
    cache = str(tmp_path / "cache")
    # 2 ranks: all of epoch 0 (8 steps of 2 x 2), then 3 steps of epoch 1, then stop
    first = launch(2, vol.url, cache, "1", "3")
    assert [r["world"] for r in first] == [2, 2]
    state = first[0]["state"]
    assert state == first[1]["state"] and (state["epoch"], state["position"]) == (1, 12)
    # 1 rank resumes the saved global position and finishes epoch 1 (10 steps of 2)
    second = launch(1, vol.url, cache, "1", "0", json.dumps(state))
    assert second[0]["world"] == 1 and second[0]["state"] == {**state, "epoch": 2, "position": 0}
    reference = vol.loader(batch_size=2, seed=13, decode=decode_augmented)
    for epoch in ("0", "1"):
        seen = [tuple(s) for r in first + second for s in r["samples"].get(epoch, [])]
        indices = [s[0] for s in seen]
        assert sorted(indices) == list(range(32)), f"epoch {epoch}: not each sample once"
        # the augmentation an uninterrupted single-process run draws for each sample
        expected = {s[0]: tuple(s) for b in reference for s in flatten(b)}
        assert all(expected[s[0]] == s for s in seen)
    # one node-wide cache: each file fetched once by the two ranks and the restarted job
    assert sum(r["metrics"]["misses"] for r in first + second) == 32
    assert second[0]["metrics"]["misses"] == 0


@pytest.mark.multiprocess
def test_ranks_that_listed_the_volume_apart_split_one_listing(make_volume, tmp_path):
    """A file landed between two nodes' listings: each rank partitioned its own index, so
    samples were served twice in the epoch and others never, with nothing said. Every
    rank now takes rank 0's listing and warns."""
    vol = make_volume(24)
    ranks = launch(2, vol.url, str(tmp_path), "apart", job="tests.data.listing_job")
    assert [r["files"] for r in ranks] == [24, 24]
    served = sorted(i for r in ranks for i in r["served"])
    assert served == list(range(24)), served  # each of rank 0's files once
    for r in ranks:
        assert any("rank 0: 24; rank 1: 25" in w for w in r["warnings"]), r["warnings"]
    assert any("1 only in this rank's (d0/s9999.txt)" in w for w in ranks[1]["warnings"])
    assert all("index_max_age" in w for r in ranks for w in r["warnings"])  # the other cause


@pytest.mark.multiprocess
def test_ranks_reading_each_a_copy_of_the_volume_keep_their_own_versions(make_volume, tmp_path):
    """Copies on each node's disk list the same files at other modification times (a
    path's version): taking rank 0's versions failed every read of the other copies."""
    vol = make_volume(12)
    ranks = launch(2, vol.url, str(tmp_path), "copies", job="tests.data.listing_job")
    assert sorted(i for r in ranks for i in r["served"]) == list(range(12))
    assert [r["warnings"] for r in ranks] == [[], []]


@pytest.mark.multiprocess
def test_a_dataset_split_over_the_ranks_but_made_on_one_says_so(make_volume, tmp_path):
    vol = make_volume(4)
    ranks = launch(2, vol.url, str(tmp_path), "alone", job="tests.data.listing_job")
    error = ranks[0]["error"]
    assert "every rank makes it" in error and "rank=0, world_size=1" in error, error
