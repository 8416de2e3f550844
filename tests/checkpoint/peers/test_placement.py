"""Which node each rank is on, and who keeps whose replica (pure)."""

from __future__ import annotations

import pytest

from unbroken.checkpoint.peers.placement import leaders, node_of_ranks, replica_targets


def test_nodes_are_numbered_by_their_lowest_rank():
    nodes = node_of_ranks(["b:1", "b:1", "a:1", "a:1", "b:2"])
    assert nodes == [0, 0, 1, 1, 2]
    assert leaders(nodes) == [0, 2, 4]
    assert leaders(node_of_ranks(["x", "y", "x", "y"])) == [0, 1]


@pytest.mark.parametrize(
    ("node", "count", "replicas", "want"),
    [
        (0, 2, 1, [1]),
        (1, 2, 1, [0]),
        (2, 3, 1, [0]),
        (0, 4, 2, [1, 2]),
        (3, 4, 2, [0, 1]),
        (0, 2, 5, [1]),  # never more than the other nodes, never itself
        (0, 1, 1, []),
        (0, 3, 0, []),
    ],
)
def test_replicas_go_to_the_next_nodes(node, count, replicas, want):
    assert replica_targets(node, count, replicas) == want


def test_every_node_is_kept_by_as_many_others_as_asked():
    for count in range(2, 7):
        for replicas in range(1, count):
            kept = [0] * count
            for node in range(count):
                for target in replica_targets(node, count, replicas):
                    kept[node] += 1
                    assert target != node
            assert kept == [replicas] * count


@pytest.mark.parametrize(("node", "count", "replicas"), [(2, 2, 1), (-1, 2, 1), (0, 2, -1)])
def test_bad_arguments_are_refused(node, count, replicas):
    with pytest.raises(ValueError):
        replica_targets(node, count, replicas)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_replicas_must_be_a_count(tmp_path, bad):
    import unbroken as ub

    with pytest.raises(ValueError, match=f"replicas must be an int >= 0, got {bad!r}"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", replicas=bad)


def test_one_process_has_no_peers(tmp_path):
    import unbroken as ub

    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", replicas=3) as mgr:
        assert mgr._peers is None and mgr._pipeline.node.replicator is None


def test_nodes_that_cannot_hold_a_replica_are_passed_over():
    assert replica_targets(0, 3, 1, holders={0, 2}) == [2]  # node 1 has no server
    assert replica_targets(2, 4, 2, holders={1, 2}) == [1]
    assert replica_targets(0, 2, 1, holders={0}) == []
