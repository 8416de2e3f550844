"""Rank programs for the multi-rank checkpoint tests (run by tests/checkpoint/distributed.py).

``python -m torch.distributed.run ... dist_scenarios.py <scenario> [options]``; every
scenario uses gloo on CPU and exits non-zero (with a message) if a check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import unbroken as ub
from tests.worker_exit import exit_after_checks
from unbroken.checkpoint.errors import SaveFailedError


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank() if dist.is_initialized() else '-'}] {msg}", flush=True)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 6))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g)


def train_step(model: nn.Module, optim, sched, step: int) -> None:
    x, y = batch(step, dist.get_rank())
    x = nn.functional.dropout(x, 0.1)  # consumes the torch RNG: resume must restore it
    loss = nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()


def full_state(model: nn.Module, optim) -> dict[str, torch.Tensor]:
    """Whole (unsharded) model and optimizer tensors, keyed by name (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = torch.as_tensor(v).detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def rng_draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def scenario_ddp(a: argparse.Namespace) -> None:
    """DDP round trip on N ranks: model, optimizer, scheduler, values, RNG; both tiers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2, 0.5)
    mgr = ub.CheckpointManager(
        a.url,
        staging_dir=a.staging,
        every_steps=3,
        keep_last=2,
        when_busy="wait",
        storage_options=json.loads(a.options),
    )
    state = {"model": model, "optim": optim, "sched": sched, "epoch": 1}
    assert mgr.restore(state) is None
    for step in range(1, 7):
        train_step(model, optim, sched, step)
        state["epoch"] = step // 3
        mgr.maybe_save(step, state)
    mgr.wait()
    expected, draws = full_state(model, optim), rng_draws()
    for t in expected.values():  # BN statistics differ per rank; rank 0's are saved
        dist.broadcast(t, src=0)
    lr = sched.get_last_lr()
    for tier in ("memory", "durable"):
        if tier == "durable":  # the node's copy is gone (a node replaced)
            dist.barrier()
            if dist.get_rank() == 0:
                import shutil

                shutil.rmtree(mgr.memory_tier.path)
                shutil.rmtree(mgr.staging_dir)
            dist.barrier()
        fresh = DDP(make_model(1))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, 0.5)
        new_state = {"model": fresh, "optim": fresh_opt, "sched": fresh_sched, "epoch": -1}
        assert mgr.restore(new_state) == 6
        assert new_state["epoch"] == 2, new_state["epoch"]
        assert fresh_sched.get_last_lr() == lr, (fresh_sched.get_last_lr(), lr)
        assert_same(full_state(fresh, fresh_opt), expected, f"DDP restore from {tier}")
        assert rng_draws() == draws, f"RNG not restored from {tier}"
        # DDP's saves spread the model over both ranks' files; one node holds both
        assert mgr.last_restore.tier == tier, mgr.last_restore.tier
    steps = [c.step for c in mgr.checkpoints() if c.committed]
    assert steps == [3, 6], steps
    try:  # a user's script that passes step= on rank 0 only
        mgr.restore(new_state, step=3 if dist.get_rank() == 0 else None)
    except ub.CheckpointError as e:
        assert "rank 0: 3, rank 1: newest" in str(e), e
        log("different steps refused")
    else:
        raise AssertionError("ranks restored different steps")
    assert_same(full_state(fresh, fresh_opt), expected, "state after the refused restore")
    mgr.close()
    log("ddp ok")


def flip_a_payload_of(step_path: Path, file: str) -> None:
    """Flip a byte of the first payload that ``step_path``'s metadata places in ``file``."""
    from tests.checkpoint.manager_util import flip_payload_byte

    doc = json.loads((step_path / "metadata.json").read_text())
    flip_payload_byte(step_path, next(d["fqn"] for d in doc["storage_data"] if d["file"] == file))


def scenario_nodes(a: argparse.Namespace) -> None:
    """One node per rank (``--staging`` holds ``{rank}``): each staging tier holds only its
    own rank's files. Restore reads what a node holds locally and the rest from the
    durable tier; a replaced node (empty staging tier) reads all from the durable tier; a
    corrupt local file sends every rank to the durable tier; a corrupt durable file read
    in the staging attempt sends every rank to the previous step."""
    import shutil
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = DDP(make_model(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2, 0.5)
    mgr = ub.CheckpointManager(
        a.url, staging_dir=a.staging, every_steps=3, when_busy="wait", memory_tier=False
    )  # the disk tier's files are looked at (the memory tier's are laid out alike)
    state = {"model": model, "optim": optim, "sched": sched}
    for step in range(1, 4):
        train_step(model, optim, sched, step)
        mgr.maybe_save(step, state)
    mgr.wait()
    expected = full_state(model, optim)
    for t in expected.values():  # BN statistics differ per rank; rank 0's are saved
        dist.broadcast(t, src=0)
    mine = sorted(os.listdir(Path(a.staging) / "step-000000000003"))
    assert f"__{rank}_0.distcp" in mine and f"__{1 - rank}_0.distcp" not in mine, mine

    warned: list[str] = []

    def restore(what: str) -> str:
        fresh = DDP(make_model(1))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, 0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            assert mgr.restore({"model": fresh, "optim": fresh_opt, "sched": fresh_sched}) == 3
        assert_same(full_state(fresh, fresh_opt), expected, f"restore {what}")
        tier = mgr.last_restore.tier
        warned[:] = [str(w.message) for w in caught]
        log(f"{what}: {tier}; warnings: {warned}")
        return tier + ("; warned" if caught else "")

    got = restore("every node whole")  # DDP's saves spread the model over both files
    assert got == "staging+durable", got
    dist.barrier()
    if rank == 1:  # node 1 replaced: its staging tier is empty
        shutil.rmtree(a.staging)
    dist.barrier()
    got = restore("node 1 replaced")
    assert got == ("durable" if rank == 1 else "staging+durable"), got
    dist.barrier()
    if rank == 0:  # a payload every rank reads: rank 0 from its disk, rank 1 remotely
        flip_a_payload_of(Path(a.staging) / "step-000000000003", "__0_0.distcp")
    dist.barrier()
    got = restore("node 0 corrupt")
    assert got == "durable; warned", got
    # A bad durable copy of node 1's file, which rank 0 reads from the durable tier in the
    # staging attempt: every rank gives step 6 up at once (a durable attempt would read the
    # same bytes; ranks that disagreed would hang in different collectives) for step 3.
    for step in range(4, 7):
        train_step(model, optim, sched, step)
        mgr.maybe_save(step, state)
    mgr.wait()
    dist.barrier()
    bad = Path(a.url) / "step-000000000006"
    if rank == 0:
        flip_a_payload_of(bad, "__1_0.distcp")
    dist.barrier()
    got = restore("durable copy corrupt")
    assert got == "durable; warned", got
    unusable = [m for m in warned if "is not usable" in m]
    assert len(unusable) == 1 and unusable[0].startswith(f"checkpoint {bad} is not"), warned
    mgr.close()
    log("nodes ok")


def fsdp_model(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def node_tiers(a: argparse.Namespace) -> dict:
    """With --node-tiers each rank is a node of its own with its own tmpfs (its memory
    tier's root), as on separate machines, and keeps its copies when it ends."""
    if not a.node_tiers:
        return {}
    tmpfs = os.path.join(a.node_tiers, f"shm-{dist.get_rank()}")
    os.makedirs(tmpfs, exist_ok=True)
    os.environ["UNBROKEN_MEMORY_DIR"] = tmpfs
    return {"memory_tier": True}


def scenario_fsdp_save(a: argparse.Namespace) -> None:
    """FSDP2 on N ranks: train, save; rank 0 keeps the whole expected state for later."""
    model = fsdp_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    mgr = ub.CheckpointManager(
        a.url, staging_dir=a.staging, every_steps=2, when_busy="wait", **node_tiers(a)
    )
    state = {"model": model, "optim": optim, "sched": sched, "note": "fsdp"}
    for step in range(1, 5):
        train_step(model, optim, sched, step)
        mgr.maybe_save(step, state)
    if a.node_tiers:  # as a crash would: the copies stay for the next start
        mgr.wait()
        mgr._close(clean=False)
    else:
        mgr.close()
    # The local shards (parameters, both Adam moments) of both saves were checksummed by
    # the staging copy, not read again by the local write.
    shards = sum(p.to_local().nbytes for p in model.parameters())
    assert mgr.stats.bytes_checksummed_in_copy >= 2 * 3 * shards, mgr.stats
    expected = full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save(expected, a.expected)
    log("fsdp save ok")


def scenario_fsdp_load(a: argparse.Namespace) -> None:
    """FSDP2 on M ranks: restore what N ranks saved, compare the whole state."""
    model = fsdp_model(7)
    optim = torch.optim.Adam(model.parameters(), lr=0.3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    mgr = ub.CheckpointManager(
        a.url, staging_dir=a.staging, every_steps=2, when_busy="wait", **node_tiers(a)
    )
    state = {"model": model, "optim": optim, "sched": sched, "note": ""}
    with __import__("warnings").catch_warnings(record=True) as caught:
        __import__("warnings").simplefilter("always")
        assert mgr.restore(state) == 4
    assert state["note"] == "fsdp"
    expected = torch.load(a.expected, weights_only=True)
    assert_same(full_state(model, optim), expected, f"FSDP2 reshard to {dist.get_world_size()}")
    saved_ws = mgr.checkpoints()[-1].world_size
    if dist.get_rank() >= saved_ws:
        assert any("no RNG state for this rank" in str(w.message) for w in caught), caught
    first = mgr.last_restore.tier
    if a.node_tiers:  # the replicas gone: what they held comes from the durable tier
        import shutil

        from unbroken.checkpoint.peers.replica_files import replicas_root

        shutil.rmtree(replicas_root(mgr.memory_tier.path), ignore_errors=True)
        dist.barrier()
        assert mgr.restore(state) == 4
        assert_same(full_state(model, optim), expected, "restore without replicas")
        log(f"fsdp load on {dist.get_world_size()} without replicas: {mgr.last_restore.tier}")
    # Training continues from the restored state on the new world size.
    train_step(model, optim, sched, 5)
    mgr.close()
    log(f"fsdp load on {dist.get_world_size()} ok from {first}")


def scenario_generators_save(a: argparse.Namespace) -> None:
    """Each rank's own torch.Generator (seeded 100 + rank) and plain value in the state:
    the draws each rank would make next are kept for the load."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    torch.rand(3, generator=g)
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None)
    shared = torch.Generator().manual_seed(5)  # a shuffle every rank draws alike
    torch.rand(2, generator=shared)
    mgr.save(1, {"model": nn.Linear(2, 2), "g": g, "s": shared, "who": [rank], "same": 5})
    mgr.close()
    draws = {name: torch.rand(4, generator=gen).tolist() for name, gen in (("g", g), ("s", shared))}
    Path(f"{a.expected}.rank{rank}").write_text(json.dumps(draws))
    log("generators save ok")


class _Position:
    """A loader-like object whose state_dict() holds this rank's own position."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def scenario_unlike_values(a: argparse.Namespace) -> None:
    """Items DCP saves once for every rank holding them, per-rank values inside: said by
    key, once. A DDP model and a value alike on every rank are not."""
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(make_model(0))
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None)
    state = {"model": model, "it": _Position(100 + rank), "seen": torch.full((3,), rank),
             "same": _Position(7)}  # fmt: skip
    for step in (1, 2):
        mgr.save(step, state)
        mgr.wait()
    mgr.close()
    log("unlike values saved")


def scenario_generators_load(a: argparse.Namespace) -> None:
    """Restore on M ranks: a rank the checkpoint saved gets its own generator back; a rank
    it did not keeps its own, with a warning naming the generator."""
    import warnings

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(999)
    own = torch.rand(4, generator=torch.Generator().manual_seed(999)).tolist()
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None)
    s = torch.Generator().manual_seed(999)
    state = {"model": nn.Linear(2, 2), "g": g, "s": s, "who": [], "same": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore(state) == 1
    mgr.close()
    draws = torch.rand(4, generator=g).tolist()
    saved = Path(f"{a.expected}.rank{rank}")
    assert state["same"] == 5
    expected_s = json.loads(Path(f"{a.expected}.rank0").read_text())["s"]
    assert torch.rand(4, generator=s).tolist() == expected_s, f"rank {rank}: shared generator"
    if saved.exists():
        assert draws == json.loads(saved.read_text())["g"], f"rank {rank}: not its own generator"
        assert state["who"] == [rank], state
    else:
        assert draws == own, f"rank {rank}: a generator of another rank"
        assert any("generators ['g']" in str(w.message) for w in caught), caught
        assert state["who"] == [0], state
        assert any("values of 'who' differed" in str(w.message) for w in caught), caught
    log(f"generators load on {dist.get_world_size()} ok")


def scenario_values_from_one_rank(a: argparse.Namespace) -> None:
    """Saved on one rank, restored on more: a new rank gets rank 0's plain values, with a
    warning naming them (one rank's save cannot tell a per-rank value from the job's)."""
    import warnings

    rank = dist.get_rank()
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None)
    state = {"model": nn.Linear(2, 2), "who": [rank], "step": 0}
    if dist.get_world_size() == 1:
        state["step"] = 3
        mgr.save(3, state)
        mgr.close()
        log("saved on one rank")
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore(state) == 3
    mgr.close()
    said = [str(w.message) for w in caught if "this rank gets rank 0's" in str(w.message)]
    assert state == {**state, "who": [0], "step": 3}, state
    if rank == 0:
        assert not said, said
    else:
        assert len(said) == 1 and "saved on one rank" in said[0], said
        assert "values of 'step', 'who' are per rank" in said[0], said
    log("values from one rank ok")


def scenario_tier_off_keeps_no_replicas(a: argparse.Namespace) -> None:
    """Two nodes; node 1's memory tier on a tmpfs too small for its snapshots goes off at
    the first save. Its peer server had started with the job and took node 0's replicas
    into that tmpfs all the same: the node a job was told keeps nothing there."""
    import warnings

    from unbroken.checkpoint.memory_tier import MEMORY_DIR_ENV

    rank = dist.get_rank()
    if rank == 1:
        os.environ[MEMORY_DIR_ENV] = a.expected  # the small tmpfs
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None)
    state = {f"w{r}": torch.full((5_000_000,), float(r)) for r in range(2)}  # 20 MB each
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            mgr.save(step, state)
            mgr.wait()
    deadline = time.monotonic() + 30
    while rank == 0 and mgr.stats.replicas_sent + mgr.stats.replicas_failed < 2:
        assert time.monotonic() < deadline, mgr.stats
        time.sleep(0.1)
    dist.barrier()
    if rank == 1:
        assert any("the memory tier is off" in str(w.message) for w in caught), caught
        held = [str(p) for p in Path(a.expected).rglob("*") if p.is_file()]
        assert not [p for p in held if "/replicas/" in p], held
    mgr.close()
    log("tier off ok")


def scenario_peer_dies_mid_save(a: argparse.Namespace) -> None:
    """Rank 1 dies while both ranks' save is in flight: rank 0's save fails, reported
    once as a failed save (no worker traceback), and nothing is committed."""
    rank = dist.get_rank()
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None, preemption="flag")
    big = {"model": nn.Linear(2, 2), "w": torch.randn(4 * 1024 * 1024)}
    mgr.save(1, big)
    if rank == 1:
        os._exit(3)  # mid-save: its upload and the commit's gather never come
    try:
        mgr.wait()
    except SaveFailedError as e:
        assert "a peer is gone" in str(e), e
        log("peer gone ok")
    assert not [c for c in mgr.checkpoints() if c.committed]
    os._exit(0)


def scenario_peer_dies_after_the_commit(a: argparse.Namespace, dying: int = 1) -> None:
    """A rank dies once the commit record is written (``dying`` 1: rank 0, the
    coordinator, writes it without the dead rank; 0: the coordinator dies right after
    writing it): the step is committed, and the survivor says so and keeps its node's
    copy."""
    import unbroken.checkpoint.pipeline as pipeline

    rank = dist.get_rank()
    if rank == dying == 1:
        real_together = pipeline.together

        def die_at_the_outcome(what, collective, obj):
            if what.startswith("committing step"):
                os._exit(3)  # after the gather: the coordinator commits without it
            return real_together(what, collective, obj)

        pipeline.together = die_at_the_outcome
    if rank == dying == 0:
        real_commit = pipeline.commit_step

        def die_once_written(*args, **kwargs):
            real_commit(*args, **kwargs)
            os._exit(3)  # the record is written; the outcome never goes out

        pipeline.commit_step = die_once_written
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=None, preemption="flag")
    torch.manual_seed(0)  # one model: the same on both ranks
    mgr.save(1, {"model": nn.Linear(2, 2)})
    mgr.wait()  # raised "save of step 1 failed: ... a peer is gone" with step 1 committed
    assert [c.step for c in mgr.checkpoints() if c.committed] == [1]
    assert not mgr.failures, mgr.failures
    roots = list(mgr._pipeline.node.stores)  # the restart restores from the node's copy
    assert any((Path(r) / "step-000000000001" / "manifest.json").exists() for r in roots), roots
    log("committed despite the peer ok")
    os._exit(0)


def scenario_collectives(a: argparse.Namespace) -> None:
    """Async saves to a slow remote while every step all_reduces on the default group.

    The cadence is by time (each rank's own clock), so "due" and "busy" must be agreed
    between ranks on every maybe_save, or the ranks' workers would run different jobs."""
    model = make_model(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = ub.CheckpointManager(
        a.url,
        staging_dir=a.staging,
        every_steps=None,
        every_seconds=0.05 * (1 + dist.get_rank()),  # a period per rank: clock skew
        keep_last=2,
        storage_options={"latency": 0.01, "bandwidth": "5MB", "link": a.link},
    )
    state = {"model": model, "optim": optim}
    for step in range(1, 41):
        x, y = batch(step, dist.get_rank())
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():  # DDP by hand: collectives on the default group
            dist.all_reduce(p.grad)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
        optim.step()
        mgr.maybe_save(step, state)
        time.sleep(0.01)
    mgr.close()
    s = mgr.stats
    assert s.committed >= 2 and s.failed == 0, s
    log(f"collectives ok: {s.committed} committed, {s.skipped_busy} skipped busy")


def scenario_group(a: argparse.Namespace) -> None:
    """The checkpoint group's object collectives: each rank's object (of another size on
    each rank) comes back whole, and the tensors they used are let go once gloo has."""
    from unbroken._util import collectives

    group = collectives.Group.create(timeout=60)
    rank = dist.get_rank()
    for i in range(40):
        mine = {"rank": rank, "round": i, "pad": "x" * (rank * 997 + i)}
        gathered = group.all_gather(mine)
        want = [{"round": i, "rank": r, "pad": "x" * (r * 997 + i)} for r in range(2)]
        assert gathered == want, f"round {i}: gathered {gathered!r:.200}"
        chosen = group.broadcast([i, "from", rank] if rank == 0 else None)
        assert chosen == [i, "from", 0], f"round {i}: broadcast gave {chosen!r}"
        assert group.any(rank == 1, i == 7, False) == (True, i == 7, False)
    big = group.all_gather("y" * (4 << 20))  # its buffers are not held past the call
    assert [len(b) for b in big] == [4 << 20] * 2
    held = collectives._nbytes(collectives._kept)
    assert held <= collectives.KEPT_BYTES_WAIT, f"{held} bytes held after the call"
    time.sleep(0.5)  # gloo's threads have let go of every work by now
    collectives.keep_until_released()
    assert collectives._kept == [], f"{len(collectives._kept)} tensors still held"
    managers_let_go_of_their_groups(a)
    log("group ok")


def managers_let_go_of_their_groups(a: argparse.Namespace) -> None:
    """A manager per evaluation or per fit(), each closed: the process keeps no gloo
    context of theirs (each held about 15 descriptors and 9 threads)."""
    model = make_model(0)

    def one(step: int) -> None:
        with ub.CheckpointManager(a.url, staging_dir=a.staging) as mgr:
            mgr.restore({"model": model})
            mgr.save(step, {"model": model})
        try:
            mgr.restore({"model": model})
        except RuntimeError as e:
            assert "is closed" in str(e), e
        else:
            raise AssertionError("a closed manager restored")

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), threading.active_count() + len(
            os.listdir("/proc/self/task")
        )

    one(1)  # pools and caches made once per process
    fds, threads = held()
    for step in range(2, 12):
        one(step)
    grown = tuple(after - before for after, before in zip(held(), (fds, threads)))
    assert grown[0] < 10 and grown[1] < 6, f"10 managers later: {grown} more fds, threads"


def scenario_retention(a: argparse.Namespace) -> None:
    """On every rank, wait() returns once the save's retention is done (the coordinator
    runs it, on a slow remote): the durable tier then holds keep_last commits. Ranks that
    save different steps, or one key's tensor in different shapes, are refused by name."""
    durable = Path(a.url.removeprefix("emulated::"))
    mgr = ub.CheckpointManager(
        a.url,
        staging_dir=a.staging,
        keep_last=1,
        storage_options={"latency": 0.05, "bandwidth": None},
    )
    state = {"model": make_model(0)}
    for step in (2, 4, 6):
        mgr.save(step, state)
        mgr.wait()
        committed = sorted(p.parent.name for p in durable.glob("step-*/manifest.json"))
        assert committed == [f"step-{step:012d}"], (step, committed)
    try:  # a step counted per rank: refused on both, naming each rank's step
        mgr.save(7 + dist.get_rank(), state)
        mgr.wait()
    except ub.StepsDisagreeError as e:
        assert "rank 0: 7, rank 1: 8" in str(e), e
    else:
        raise AssertionError("the ranks saved different steps")
    mgr.save(8, state)  # agreed again: it commits
    mgr.wait()
    state["t"] = torch.zeros(3 + dist.get_rank())  # one key, a shape per rank: unrestorable
    try:
        mgr.save(10, state)
        mgr.wait()
    except ub.SaveRefusedError as e:
        assert "state key 't' is a tensor of shape [3]" in str(e) and "[4]" in str(e), e
        assert type(e.__cause__).__name__ == "UnlikeCopiesError", repr(e.__cause__)
    else:
        raise AssertionError("a tensor of another shape on each rank was saved")
    del state["t"]
    mgr.save(12, state)
    mgr.wait()
    mgr.close()
    log("retention ok")


def scenario_tight_tier(a: argparse.Namespace) -> None:
    """Two ranks of one node, DDP's replicated state, a tmpfs that holds the node's two
    snapshots and little more: every save stays in the memory tier. Each rank stages
    every tensor but writes half (DCP writes a replicated tensor once): sized by what
    it stages, every other save went to disk."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(1120, 1120))  # 15 MB with Adam: two fit the tmpfs, not three
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, memory_tier=True)
    state = {"model": model, "optim": optim}
    for step in range(1, 7):
        model(torch.randn(4, 1120)).sum().backward()
        optim.step()
        mgr.save(step, state)
        mgr.wait()
        held = Path(mgr.memory_tier.path) / f"step-{step:012d}" / "manifest.json"
        assert held.exists(), f"step {step} went to the disk tier"
    mgr.close()
    log("tight tier ok")


def scenario_node_room(a: argparse.Namespace) -> None:
    """Two ranks of one node, 8 MiB replicated: each writes half. After a save that
    found no room (the disk tier took it), room for 6 MiB above the tmpfs's reserve:
    each rank's half fits, both halves do not. That save goes to disk too, and the
    reserve is kept."""
    from unbroken.checkpoint.memory_tier import space, tree_bytes

    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 8 x 1 MiB
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=1, keep_last=2)
    tier = Path(mgr.memory_tier.path)
    filler = tier.parent.parent / "another-programs-file"

    def leave_room(nbytes: int) -> None:  # another program takes the rest above the reserve
        held = filler.stat().st_size if filler.exists() else 0
        room = space(str(tier))
        filler.write_bytes(
            b"\0" * (room.free + held + tree_bytes(str(tier)) - room.reserve - nbytes)
        )

    for step, room in ((1, None), (2, 1 << 20), (3, 6 << 20)):
        if room is not None and dist.get_rank() == 0:
            leave_room(room)
        dist.barrier()
        mgr.save(step, state)
        mgr.wait()
        dist.barrier()
        if step > 1:
            assert not (tier / f"step-{step:012d}").exists(), f"step {step} in memory"
            assert (Path(a.staging) / f"step-{step:012d}" / "manifest.json").exists()
    room = space(str(tier))
    assert room.free >= room.reserve, (room.free, room.reserve)
    mgr.close()
    log("node room ok")


def scenario_train(a: argparse.Namespace) -> None:
    """Resumable training; rank 1 dies once at --crash-at (recovery under --max-restarts)."""
    model = make_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, 3, 0.7)
    mgr = ub.CheckpointManager(
        a.url, staging_dir=a.staging, every_steps=a.every, keep_last=2, when_busy="wait"
    )
    state = {"model": model, "optim": optim, "sched": sched}
    start = mgr.restore(state) or 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log(f"attempt {restart}: resuming after step {start}")
    for step in range(start + 1, a.steps + 1):
        if a.crash_at and step == a.crash_at and dist.get_rank() == 1 and restart == 0:
            mgr.wait()
            log(f"crashing at step {step}")
            os._exit(17)
        x, y = batch(step, 0)
        x = nn.functional.dropout(x, 0.2)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optim.step()
        sched.step()
        mgr.maybe_save(step, state)
    mgr.close()
    if dist.get_rank() == 0:
        torch.save({k: v for k, v in model.state_dict().items()}, a.expected)
        Path(a.expected + ".json").write_text(json.dumps({"resumed_from": start}))
    log("train ok")


def scenario_churn(a: argparse.Namespace) -> None:
    """Save every step with tensors that all hold the step number (killed -9 from outside)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]))
    extra = torch.zeros(300_000)
    mgr = ub.CheckpointManager(a.url, staging_dir=a.staging, every_steps=1, keep_last=3)
    state = {"model": model, "extra": extra, "step": 0}
    start = mgr.restore(state) or 0
    step = start
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
            extra.fill_(float(step))
        state["step"] = step
        mgr.maybe_save(step, state)
        if step == start + 1:
            log(f"churning from step {step}")
        time.sleep(0.005)


def scenario_replicas(a: argparse.Namespace) -> None:
    """One node per rank, each with its memory tier: after a commit each node's files are
    in the other's memory too. A replaced node (empty disk and memory) restores from its
    peer's memory, bitwise; with that peer's server gone, from the durable tier; a node
    that saves again after its replacement is replicated again."""
    import shutil

    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.checkpoint.peers.replica_files import rank_dir

    rank = dist.get_rank()
    model = DDP(make_model(0))
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2, 0.5)
    mgr = ub.CheckpointManager(
        a.url, staging_dir=a.staging, every_steps=3, when_busy="wait", memory_tier=True
    )
    state = {"model": model, "optim": optim, "sched": sched}
    for step in range(1, 4):
        train_step(model, optim, sched, step)
        mgr.maybe_save(step, state)
    mgr.wait()
    assert mgr.stats.replicas_sent == 1 and mgr.stats.bytes_replicated > 0, mgr.stats
    expected = full_state(model, optim)
    for t in expected.values():  # BN statistics differ per rank; rank 0's are saved
        dist.broadcast(t, src=0)
    tier = Path(mgr.memory_tier.path)
    held = sorted(os.listdir(rank_dir(str(tier), 1 - rank) + "/step-000000000003"))
    assert f"__{1 - rank}_0.distcp" in held and "manifest.json" in held, held

    def restore(what: str) -> str:
        fresh = DDP(make_model(1))
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, 0.5)
        assert mgr.restore({"model": fresh, "optim": fresh_opt, "sched": fresh_sched}) == 3
        assert_same(full_state(fresh, fresh_opt), expected, f"restore {what}")
        log(f"{what}: {mgr.last_restore.tier}")
        return mgr.last_restore.tier

    got = restore("every node whole")  # each node holds the other's files in its memory
    assert got == "memory+replica", got
    dist.barrier()
    if rank == 1:  # node 1 replaced: nothing on its disk, nothing in its memory
        shutil.rmtree(a.staging)
        shutil.rmtree(tier)
    dist.barrier()
    got = restore("node 1 replaced")
    assert got == ("peer" if rank == 1 else "memory+replica"), got
    for step in range(4, 7):  # the replaced node saves again and is replicated again
        train_step(model, optim, sched, step)
        mgr.maybe_save(step, state)
    mgr.wait()
    assert mgr.stats.replicas_sent == 2, mgr.stats
    # Rank 1's wait saw its replica acknowledged, older steps dropped: look after it.
    dist.barrier()
    if rank == 0:
        held = sorted(os.listdir(rank_dir(str(tier), 1) + "/step-000000000006"))
        assert "__1_0.distcp" in held and "manifest.json" in held, held
        assert not os.path.exists(rank_dir(str(tier), 1) + "/step-000000000003")
    expected = full_state(model, optim)
    for t in expected.values():
        dist.broadcast(t, src=0)
    dist.barrier()
    if rank == 1:  # node 1 replaced again
        shutil.rmtree(a.staging, ignore_errors=True)
        shutil.rmtree(tier)
    elif rank == 0:  # and node 0's server is gone: node 1 reads the durable tier
        mgr._peers.close()
    dist.barrier()
    fresh = DDP(make_model(1))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, 0.5)
    assert mgr.restore({"model": fresh, "optim": fresh_opt, "sched": fresh_sched}) == 6
    assert_same(full_state(fresh, fresh_opt), expected, "restore with the peer gone")
    log(f"peer gone: {mgr.last_restore.tier}")
    got = mgr.last_restore.tier
    assert got == ("durable" if rank == 1 else "memory+replica"), got
    mgr.close()
    log("replicas ok")


def manager_before_init_process_group() -> ub.CheckpointManager:
    """Refused under torchrun; made where no WORLD_SIZE says the world is larger (a
    launcher that passes rank and world size to init_process_group itself)."""
    try:
        ub.CheckpointManager(tempfile.mkdtemp(), staging_dir=tempfile.mkdtemp())
    except RuntimeError as e:
        assert "Call torch.distributed.init_process_group(" in str(e), e
    else:
        raise AssertionError("a manager made before init_process_group under torchrun")
    world = os.environ.pop("WORLD_SIZE")
    try:
        return ub.CheckpointManager(tempfile.mkdtemp(), staging_dir=tempfile.mkdtemp())
    finally:
        os.environ["WORLD_SIZE"] = world


def refuses_to_act_alone(mgr: ub.CheckpointManager) -> None:
    for call in (lambda: mgr.save(1, {"w": torch.ones(2)}), lambda: mgr.restore({})):
        try:
            call()
        except RuntimeError as e:
            assert "before torch.distributed.init_process_group" in str(e), e
        else:
            raise AssertionError("a manager made before init_process_group acted alone")
    mgr.close()
    assert mgr.checkpoints() == []
    log("a manager made before init_process_group refused")


SCENARIOS = {
    "ddp": scenario_ddp,
    "nodes": scenario_nodes,
    "fsdp_save": scenario_fsdp_save,
    "fsdp_load": scenario_fsdp_load,
    "collectives": scenario_collectives,
    "retention": scenario_retention,
    "group": scenario_group,
    "generators_save": scenario_generators_save,
    "peer_dies_mid_save": scenario_peer_dies_mid_save,
    "peer_dies_after_the_commit": scenario_peer_dies_after_the_commit,
    "coordinator_dies_after_the_commit": functools.partial(
        scenario_peer_dies_after_the_commit, dying=0
    ),
    "generators_load": scenario_generators_load,
    "unlike_values": scenario_unlike_values,
    "values_from_one_rank": scenario_values_from_one_rank,
    "tier_off_keeps_no_replicas": scenario_tier_off_keeps_no_replicas,
    "train": scenario_train,
    "tight_tier": scenario_tight_tier,
    "node_room": scenario_node_room,
    "churn": scenario_churn,
    "replicas": scenario_replicas,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--url", required=True)
    p.add_argument("--staging", required=True)
    p.add_argument("--expected", default="")
    p.add_argument("--link", default="test")
    p.add_argument("--options", default="{}", help="storage options (JSON)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--node-tiers", default="", help="each rank a node with its own tmpfs here")
    a = p.parse_args()
    if "{rank}" in a.staging:
        a.staging = a.staging.format(rank=os.environ.get("RANK", "0"))
    # A manager made before init_process_group must not act alone on one of several ranks:
    # refused at once where the launcher's WORLD_SIZE says so, else at its first save.
    early = None
    if a.scenario == "ddp":
        early = manager_before_init_process_group()
    dist.init_process_group("gloo")
    if early is not None:
        refuses_to_act_alone(early)
    try:
        SCENARIOS[a.scenario](a)
    except SaveFailedError as e:
        log(f"FAILED: {e}")
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_after_checks()
