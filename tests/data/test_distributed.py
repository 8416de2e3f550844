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


def launch(world: int, *args: str) -> list[dict]:
    """Start ``world`` ranks of tests.data.dist_job; their JSON results by rank."""
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
                [sys.executable, "-m", "tests.data.dist_job", *args],
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
def test_gloo_job_resumed_on_another_world_size(make_volume, tmp_path):
    vol = make_volume(30)
    cache = str(tmp_path / "cache")
    first = launch(2, vol.url, cache, "3")  # 2 ranks, 3 steps of 2 x 2 samples, then stop
    assert [r["world"] for r in first] == [2, 2]
    state = first[0]["state"]
    assert state == first[1]["state"] and state["position"] == 12
    second = launch(3, vol.url, cache, "0", json.dumps(state))  # 3 ranks: the rest
    seen = [tuple(s) for r in first + second for s in r["samples"]]
    indices = [s[0] for s in seen]
    assert len(indices) == len(set(indices)) == 12 + 18  # 30 - 12 = 18 = 3 steps of 6
    assert second[0]["state"] == {**state, "epoch": 1, "position": 0}
    # same augmentation as an uninterrupted single-process run would draw
    reference = vol.loader(batch_size=2, seed=13, drop_last=False, decode=decode_augmented)
    expected = {s[0]: tuple(s) for b in reference for s in flatten(b)}
    assert all(expected[s[0]] == s for s in seen)
