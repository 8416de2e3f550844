"""Two "nodes" on one machine: a node lost and replaced by one with an empty local disk.

Two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1), one rank each, each
node with its own staging directory and data cache. Node 1 is killed whole (its agent
and its rank) between two saves and a replacement starts on an empty staging directory
and cache: it restores from node 0's memory (its peer server, which kept node 1's
replica), node 0 (restarted by its agent) from its own memory tier (its own files and
that replica), and the run ends bitwise equal to an uninterrupted one. Node 0 hosts
torchrun's rendezvous store: losing it would end the job (see ``Agent``), so it is the
other node that goes.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.checkpoint.distributed import free_port
from tests.e2e.harness import Agent, committed_steps, memory_tiers_of, read_result, save_phase
from tests.e2e.test_crash_harness import EXAMPLES, faulty_remote, launch
from unbroken.checkpoint.format.manifest import step_dir

pytestmark = pytest.mark.multiprocess

SCRIPT = "train_classifier.py"
STEPS, EVERY = 64, 8  # windows enough to catch one between a replica and the next save


def start_node(rank: int, endpoint: str, volume, run, staging: str, remote: dict) -> Agent:
    args = [
        "--data", f"emulated::{volume}", "--checkpoints", f"emulated::{run / 'durable'}",
        "--staging-dir", str(run / staging), "--storage-options", json.dumps(remote),
        "--steps", str(STEPS), "--every-steps", str(EVERY), "--log-every", "1",
        "--result", str(run / "result.json"), *EXAMPLES[SCRIPT][1],
    ]  # fmt: skip
    return Agent(
        SCRIPT, args, nproc=1, nnodes=2, endpoint=endpoint, hosts_store=rank == 0,
        max_restarts=1, env={"UNBROKEN_CACHE_DIR": str(run / f"cache-{staging}")},
        durable=run / "durable",
    )  # fmt: skip


def replica_held(run, step: int) -> bool:
    """Node 0's memory tier holds node 1's (rank 1's) replica of ``step``, sealed."""
    return any(
        (tier / "replicas" / "rank-00001" / step_dir(step) / "manifest.json").exists()
        for tier in memory_tiers_of(run / "staging-0")
    )


def wait_between_saves(run, staging: list, since: float, after: int) -> set[int]:
    """Wait until a step past ``after`` is committed, copied into every staging tier and
    replicated to node 0 (a node lost before its replica lands has its files read from
    the durable tier), and no newer save has begun; the committed steps then."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        committed = committed_steps(run / "durable")
        newest = max(committed, default=0)
        if (
            newest > after
            and replica_held(run, newest)
            and save_phase(run / "durable", staging, since, world_size=2) == "step"
        ):
            return committed
        time.sleep(0.02)
    raise AssertionError("no commit whose replica landed before the next save began")


@pytest.mark.slow  # CI: test_manager_dist's one node per rank covers the per-node reads
@pytest.mark.timeout(600)
def test_a_replaced_node_restores_from_its_peers_memory_the_other_from_its_own(
    tmp_path, jpeg_volume
):
    reference = launch(SCRIPT, jpeg_volume, tmp_path, "reference", STEPS, EVERY)
    run, remote = tmp_path / "nodes", faulty_remote()
    endpoint = f"127.0.0.1:{free_port()}"
    survivor = start_node(0, endpoint, jpeg_volume, run, "staging-0", remote)
    lost = start_node(1, endpoint, jpeg_volume, run, "staging-1", remote)
    replacement = None
    try:
        line, _ = survivor.wait_for_starts(1)
        lost.wait_for_starts(1)
        staging = [run / "staging-0", run / "staging-1"]
        committed = wait_between_saves(run, staging, survivor.lines[line][0], after=EVERY)
        lost.kill()  # the whole node: its agent and its rank
        replacement = start_node(1, endpoint, jpeg_volume, run, "staging-new", remote)
        survivor.finish(timeout=300)
        replacement.finish(timeout=300)
        reference.finish(timeout=300)
    finally:
        for agent in (survivor, lost, replacement, reference):
            if agent is not None:
                agent.kill()

    newest = max(committed)
    (*_, (_, _, kept_step, kept_tier)) = survivor.starts()
    ((_, _, new_step, new_tier),) = replacement.starts()
    assert kept_step == new_step >= newest, (committed, survivor.output, replacement.output)
    assert new_tier == "peer", replacement.output  # empty tiers: all from node 0's memory
    assert kept_tier == "memory+replica", survivor.output  # its own copy, node 1's replica
    assert all(committed for _, committed in survivor.restored + replacement.restored)
    result, want = read_result(run / "result.json"), read_result(
        tmp_path / "reference" / "result.json"
    )
    assert result["samples_sha256"] == want["samples_sha256"]
    for got, expected in zip(result["ranks"], want["ranks"]):
        assert got["weights_sha256"] == expected["weights_sha256"]
        assert got["optimizer_sha256"] == expected["optimizer_sha256"]
    print(f"node 1 lost after {sorted(committed)} committed: both restored {kept_step}, "
          f"node 0 from {kept_tier}, the new node 1 from {new_tier}")  # fmt: skip
