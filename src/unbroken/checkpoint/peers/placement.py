"""Which node a rank lives on and which nodes hold a node's replicas (pure)."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def node_of_ranks(identities: Sequence[str]) -> list[int]:
    """Each rank's node index, from each rank's node identity (host and memory tier):
    nodes are numbered in the order of their lowest rank, as torchrun numbers them."""
    index: dict[str, int] = {}
    return [index.setdefault(ident, len(index)) for ident in identities]


def leaders(nodes: Sequence[int]) -> list[int]:
    """The lowest rank of each node, by node index."""
    first: dict[int, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return [first[n] for n in sorted(first)]


def replica_targets(
    node: int, node_count: int, replicas: int, holders: Collection[int] | None = None
) -> list[int]:
    """The nodes that keep copies of ``node``'s snapshot: the next ``replicas`` nodes by
    index, wrapping round, never the node itself, skipping nodes that cannot hold one
    (``holders``: the nodes that can; None: all), fewer where the job has fewer."""
    if node_count < 1 or not 0 <= node < node_count:
        raise ValueError(f"node {node} is not one of {node_count} nodes")
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    after = [(node + i) % node_count for i in range(1, node_count)]
    able = [n for n in after if holders is None or n in holders]
    return able[:replicas]
