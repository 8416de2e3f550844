"""One rank of bench/checkpoint/peer_restore.py's job: two nodes of one rank each.

Each rank is a node of its own (its staging directory, its tmpfs root), the durable
tier a real S3 server. Commit one step (its replica goes to the other node), then time
restores on the replaced node 1 (staging directory and memory tier emptied) from its
peer's memory and from S3 alone, interleaved; then time a compute loop while a save
runs in the background, with replication on, off, and with no save, interleaved; then
node 0's server is killed and node 1 must still restore, from S3. Every restore is
checked bitwise. Prints ``RESULT {json}`` per rank.

    bench/checkpoint/peer_restore_job.py URL STAGING_BASE SHM_BASE MIB REPS OPTIONS WINDOW_S
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import unbroken as ub

COLUMNS = 4096


def compute(steps: int) -> None:
    """The training loop's stand-in: one core of matrix products."""
    a = torch.full((384, 384), 0.01)
    for _ in range(steps):
        a = torch.tanh(a @ a)


def calibrate(seconds: float) -> int:
    t = time.perf_counter()
    compute(20)
    per = (time.perf_counter() - t) / 20
    steps = torch.tensor([max(1, int(seconds / per))])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # both ranks run the same loop
    return int(steps)


def restore_once(mgr: ub.CheckpointManager, state: dict, reference: torch.Tensor) -> dict:
    state["w"].to_local().zero_()
    dist.barrier()
    t = time.perf_counter()
    mgr.restore(state)
    seconds = time.perf_counter() - t
    if not torch.equal(state["w"].to_local(), reference):
        raise AssertionError(f"rank {dist.get_rank()}: restored bytes differ")
    return {"seconds": seconds, "tier": mgr.last_restore.tier}


def main(
    url: str, staging: str, shm: str, mib: int, reps: int, options: str, window: float
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["UNBROKEN_MEMORY_DIR"] = os.path.join(shm, f"node-{rank}")
    os.makedirs(os.environ["UNBROKEN_MEMORY_DIR"], exist_ok=True)
    # A tensor sharded over the ranks (as FSDP2 shards parameters): each rank's own bytes.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(rank)
    reference = torch.randn((mib << 18) // COLUMNS, COLUMNS)  # 2-D: DTensor's planning
    # of a 1-D shard builds an index as long as the tensor (seconds at 1 GiB)
    state = {"w": DTensor.from_local(reference.clone(), mesh, [Shard(0)])}
    common = dict(
        staging_dir=os.path.join(staging, f"node-{rank}"), every_steps=1, when_busy="wait",
        storage_options=json.loads(options), memory_tier=True, goodput=False, mlflow=False,
    )  # fmt: skip
    mgr = ub.CheckpointManager(url, **common)
    mgr.save(1, state)
    mgr.wait()
    replicated = mgr.stats.replicas_sent  # the first commit's replica reached the peer

    def replaced() -> None:  # node 1 lost: nothing on its disk or in its memory
        dist.barrier()
        if rank == 1:
            shutil.rmtree(common["staging_dir"], ignore_errors=True)
            shutil.rmtree(mgr.memory_tier.path, ignore_errors=True)
        dist.barrier()

    rows: dict[str, list[dict]] = {"memory": [], "peer": [], "s3": []}
    peers = mgr._peers
    for rep in range(reps):  # interleaved: the machine's drift hits each alike
        mgr.save(2 + rep, state)  # node 1 whole again: its own copy in its memory tier
        mgr.wait()
        rows["memory"].append(restore_once(mgr, state, reference))
        replaced()
        rows["peer"].append(restore_once(mgr, state, reference))
        replaced()
        mgr._peers = None  # no peer asked: every byte from S3
        rows["s3"].append(restore_once(mgr, state, reference))
        mgr._peers = peers

    # What a save costs the loop with replication on and off: a fixed compute loop (the
    # training) runs while the save goes on in the background; the loop's wall against
    # the same loop with no save. Interleaved none / off / on. Long enough to hold the
    # commit and the replica; what outlasts it ("tail") is shown too.
    steps = calibrate(seconds=window)
    walls: dict[str, list[float]] = {"none": [], "off": [], "on": []}
    tails: dict[str, list[float]] = {"off": [], "on": []}
    replicator = mgr._pipeline.node.replicator
    for i in range(3 * reps):
        mode = ("none", "off", "on")[i % 3]
        mgr._pipeline.node.replicator = replicator if mode == "on" else None
        state["w"].to_local().add_(1.0)
        dist.barrier()
        t = time.perf_counter()
        if mode != "none":
            mgr.save(10 + i, state)
        compute(steps)
        walls[mode].append(time.perf_counter() - t)
        t = time.perf_counter()
        mgr.wait()  # the commit, and with replication on the replica too
        if mode != "none":
            tails[mode].append(time.perf_counter() - t)
    mgr._pipeline.node.replicator = replicator
    state["w"].to_local().copy_(reference)
    mgr.save(100, state)
    mgr.wait()

    dist.barrier()  # both holders of node 1's piece lost: node 1 replaced, node 0's server gone
    if rank == 0:
        peers.close()
    replaced()
    lost = restore_once(mgr, state, reference)
    mgr.close()
    nbytes = reference.nbytes
    print("RESULT " + json.dumps({
        "rank": rank, "bytes": nbytes, "replicated": replicated, "restore": rows,
        "loop": walls, "tails": tails, "both_lost": lost,
    }), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5], float(a[6]))
