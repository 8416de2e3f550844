"""CheckpointManager across real ranks launched by torchrun (gloo on CPU)."""

from __future__ import annotations

import json

import pytest
import torch

import unbroken as ub
from tests.link_names import private_link
from unbroken.checkpoint.format.manifest import step_dir

from .distributed import check, torchrun

pytestmark = pytest.mark.multiprocess


@pytest.mark.s3
def test_ddp_round_trip_on_two_ranks_both_tiers_s3(tmp_path, s3_server):
    """Both ranks upload to the loopback S3 server; restore from staging, then from S3."""
    url = f"s3://{s3_server.new_root()}/run/ckpt"
    options = json.dumps(s3_server.storage_options)
    out = check(
        torchrun(2, "ddp", "--url", url, "--staging", str(tmp_path / "s"), "--options", options)
    )
    assert out.count("ddp ok") == 2
    assert out.count("different steps refused") == 2
    assert out.count("a manager made before init_process_group refused") == 2
    store = ub.open_store(url, **s3_server.storage_options)
    names = {e.key.split("/", 1)[1] for e in store.list(step_dir(6))}
    assert {"__0_0.distcp", "__1_0.distcp", "rng/rank-00001.json", "manifest.json"} <= names


def test_fsdp2_reshards_two_to_one_and_three(tmp_path):
    common = ["--url", str(tmp_path / "d"), "--expected", str(tmp_path / "expected.pt")]
    check(torchrun(2, "fsdp_save", *common, "--staging", str(tmp_path / "s2")))
    out1 = check(torchrun(1, "fsdp_load", *common, "--staging", str(tmp_path / "s1")))
    assert "fsdp load on 1 ok from durable" in out1  # a staging_dir of its own
    out3 = check(torchrun(3, "fsdp_load", *common, "--staging", str(tmp_path / "s3")))
    assert out3.count("fsdp load on 3 ok") == 3


def test_fsdp2_reshards_from_the_nodes_memory_and_a_peers(tmp_path):
    """2 nodes -> 1: the node left holds the other's replica in its memory (without it,
    those files come from the durable tier beside its own from memory); 1 node -> 2: the
    new node reads the old one's memory through its peer server."""

    def nodes(name: str) -> list[str]:
        return ["--node-tiers", str(tmp_path / "tmpfs"), "--staging", str(tmp_path / name)]

    two = ["--url", str(tmp_path / "d2"), "--expected", str(tmp_path / "2.pt"), *nodes("a{rank}")]
    check(torchrun(2, "fsdp_save", *two))
    out = check(torchrun(1, "fsdp_load", *two))
    assert "fsdp load on 1 ok from memory+replica" in out, out
    assert "fsdp load on 1 without replicas: memory+durable" in out, out
    one = ["--url", str(tmp_path / "d1"), "--expected", str(tmp_path / "1.pt"), *nodes("b{rank}")]
    check(torchrun(1, "fsdp_save", *one))
    out = check(torchrun(2, "fsdp_load", *one))
    assert "[rank 0] fsdp load on 2 ok from memory" in out, out
    assert "[rank 1] fsdp load on 2 ok from peer" in out, out


def test_each_rank_restores_its_own_generator_and_values_on_any_world_size(tmp_path):
    """Issue 29.4: a generator seeded 100 + rank came back as rank 0's on every rank (so
    did a plain value kept per rank)."""
    common = ["--url", str(tmp_path / "d"), "--expected", str(tmp_path / "draws")]
    check(torchrun(2, "generators_save", *common, "--staging", str(tmp_path / "s2")))
    out2 = check(torchrun(2, "generators_load", *common, "--staging", str(tmp_path / "l2")))
    assert out2.count("generators load on 2 ok") == 2
    out3 = check(torchrun(3, "generators_load", *common, "--staging", str(tmp_path / "l3")))
    assert out3.count("generators load on 3 ok") == 3


def test_plain_values_saved_on_one_rank_are_named_on_each_new_rank(tmp_path):
    """Saved on one rank and restored on two, rank 1 took rank 0's plain values without
    a word (the docs promise a warning naming them, as from two saving ranks)."""
    url = ["--url", str(tmp_path / "d")]
    check(torchrun(1, "values_from_one_rank", *url, "--staging", str(tmp_path / "s1")))
    out = check(torchrun(2, "values_from_one_rank", *url, "--staging", str(tmp_path / "s2")))
    assert out.count("values from one rank ok") == 2, out


def test_per_rank_values_inside_a_state_dict_are_said_once_by_key(tmp_path):
    """A per-rank position inside an object's state_dict (or a per-rank tensor of one
    shape) came back from another rank, without a word."""
    out = check(torchrun(2, "unlike_values", "--url", str(tmp_path / "d"),
                         "--staging", str(tmp_path / "s")))  # fmt: skip
    assert out.count("unlike values saved") == 2
    said = [ln for ln in out.splitlines() if "hold other values on other ranks" in ln]
    assert len(said) == 1, out  # once, not once per save
    assert "'it.pos' (ranks 0 and 1)" in said[0] and "'seen' (ranks 0 and 1)" in said[0]
    assert "same" not in said[0] and "model" not in said[0]


def test_a_peer_dying_mid_save_fails_the_save_without_a_worker_traceback(tmp_path):
    """Issue 29.18: the survivor's checkpoint worker logged "unexpected error" with a
    traceback when a peer died during a save; it is a failed save like any other."""
    out = torchrun(2, "peer_dies_mid_save", "--url", str(tmp_path / "d"), "--staging",
                   str(tmp_path / "s{rank}")).stdout  # fmt: skip
    assert "peer gone ok" in out, out
    assert "unexpected error" not in out, out


@pytest.mark.parametrize("scenario", ["peer_dies_after_the_commit",
                                      "coordinator_dies_after_the_commit"])  # fmt: skip
def test_a_rank_dying_after_the_commit_record_leaves_the_step_committed_on_the_survivor(
    tmp_path, scenario
):
    """The demo: a rank killed as step 30's commit record was written. The survivor
    reported "save of step 30 failed ... a peer is gone" for a committed step and removed
    its node's copy, so the restarts read the durable tier."""
    out = torchrun(2, scenario, "--url", str(tmp_path / "d"), "--staging",
                   str(tmp_path / "s{rank}")).stdout  # fmt: skip
    assert "committed despite the peer ok" in out, out


def test_user_collectives_during_async_saves_do_not_deadlock(tmp_path):
    out = check(
        torchrun(
            2,
            "collectives",
            "--url",
            "emulated::" + str(tmp_path / "d"),
            "--staging",
            str(tmp_path / "s"),
            "--link",
            private_link("collectives"),
            timeout=150,
        )
    )
    assert out.count("collectives ok") == 2


def test_the_groups_object_collectives_round_trip_and_let_go_of_their_tensors(tmp_path):
    out = check(torchrun(2, "group", "--url", str(tmp_path / "d"), "--staging", str(tmp_path)))
    assert out.count("group ok") == 2


def test_ranks_of_a_node_with_replicated_state_keep_every_save_in_a_tight_tier(
    tmp_path, small_tmpfs
):
    out = check(
        torchrun(2, "tight_tier", "--url", str(tmp_path / "d"), "--staging", str(tmp_path / "s"))
    )
    assert out.count("tight tier ok") == 2


def test_a_node_whose_memory_tier_goes_off_keeps_no_peers_replicas(
    tmp_path, small_tmpfs, monkeypatch
):
    """Node 1's 64 MiB tmpfs cannot hold its snapshots: its tier goes off, and node 0's
    replicas must not fill that tmpfs either (its peer server started with the job)."""
    monkeypatch.delenv("UNBROKEN_MEMORY_DIR")  # node 0: the default tmpfs; node 1 sets it
    out = check(torchrun(2, "tier_off_keeps_no_replicas", "--url", str(tmp_path / "d"),
                         "--staging", str(tmp_path / "node-{rank}"),
                         "--expected", str(small_tmpfs)))  # fmt: skip
    assert out.count("tier off ok") == 2


def test_the_ranks_of_a_node_never_fill_its_tier_past_the_reserve_together(tmp_path, small_tmpfs):
    out = check(
        torchrun(2, "node_room", "--url", str(tmp_path / "d"), "--staging", str(tmp_path / "s"))
    )
    assert out.count("node room ok") == 2


def test_wait_covers_the_coordinators_retention_on_every_rank(tmp_path):
    durable = "emulated::" + str(tmp_path / "d")
    out = check(torchrun(2, "retention", "--url", durable, "--staging", str(tmp_path / "s{rank}")))
    assert out.count("retention ok") == 2


def test_recovery_under_torchrun_max_restarts_is_exact(tmp_path):
    ref = tmp_path / "ref.pt"
    crashed = tmp_path / "crashed.pt"
    check(
        torchrun(
            2,
            "train",
            "--url",
            str(tmp_path / "d1"),
            "--staging",
            str(tmp_path / "s1"),
            "--expected",
            str(ref),
        )
    )
    out = check(
        torchrun(
            2,
            "train",
            "--url",
            str(tmp_path / "d2"),
            "--staging",
            str(tmp_path / "s2"),
            "--expected",
            str(crashed),
            "--crash-at",
            "7",
            max_restarts=2,
            timeout=180,
        )
    )
    assert "crashing at step 7" in out and "attempt 1: resuming after step 6" in out
    assert json.loads((tmp_path / "crashed.pt.json").read_text()) == {"resumed_from": 6}
    a, b = torch.load(ref, weights_only=True), torch.load(crashed, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after recovery"


def test_each_node_restores_what_it_holds_from_its_own_staging_tier(tmp_path):
    """One node per rank: staging tiers that each hold one rank's files are still read."""
    staging = str(tmp_path / "node-{rank}")
    out = check(torchrun(2, "nodes", "--url", str(tmp_path / "d"), "--staging", staging))
    assert out.count("nodes ok") == 2
    assert "[rank 1] node 1 replaced: durable" in out
    assert "[rank 0] node 0 corrupt: durable" in out and "is not usable" in out
    assert "[rank 1] durable copy corrupt: durable" in out


def test_a_replaced_node_restores_from_its_peers_memory(tmp_path):
    """Replicas: each node's commit lands in the other's memory tier too; a replaced node
    reads it from there, bitwise, and from the durable tier once that peer is gone."""
    staging = str(tmp_path / "node-{rank}")
    out = check(torchrun(2, "replicas", "--url", str(tmp_path / "d"), "--staging", staging))
    assert out.count("replicas ok") == 2
    assert "[rank 1] node 1 replaced: peer" in out
    assert "[rank 1] peer gone: durable" in out and "is given up" in out
