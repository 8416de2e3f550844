"""The eviction policy as pure functions: next use across plans, victim order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from unbroken.data.cache.eviction import Candidate, evict_until, eviction_order, next_use

names = st.sampled_from(list("abcdefgh"))
plans = st.lists(
    st.lists(names, max_size=20).flatmap(
        lambda ns: st.tuples(st.just(ns), st.integers(0, len(ns) + 2))
    ),
    max_size=4,
)


@given(plans)
def test_next_use_is_the_nearest_future_access_over_all_plans(plans):
    got = next_use(plans)
    for name in "abcdefgh":
        distances = [
            i - cursor
            for ns, cursor in plans
            for i, n in enumerate(ns)
            if n == name and i >= cursor
        ]
        assert got.get(name) == (min(distances) if distances else None)


def test_next_use_ignores_what_is_already_consumed():
    assert next_use([(["a", "b", "a", "c"], 1)]) == {"b": 0, "a": 1, "c": 2}
    assert next_use([(["a", "b"], 2)]) == {}


def test_order_unplanned_oldest_first_then_furthest_next_use():
    cands = [
        Candidate("near", 1, last_used=1.0),
        Candidate("far", 1, last_used=9.0),
        Candidate("old", 1, last_used=0.5),
        Candidate("new", 1, last_used=5.0),
    ]
    order = [c.name for c in eviction_order(cands, {"near": 1, "far": 7})]
    assert order == ["old", "new", "far", "near"]


@given(
    st.lists(st.tuples(names, st.integers(1, 50), st.floats(0, 100)), unique_by=lambda t: t[0]),
    st.dictionaries(names, st.integers(0, 30)),
    st.integers(0, 400),
    st.sets(names),
)
def test_evict_until_frees_enough_in_order_and_skips_pinned(raw, upcoming, need, pinned):
    cands = [Candidate(n, s, t) for n, s, t in raw]
    evicted = evict_until(cands, upcoming, need, lambda c: c.name not in pinned)
    order = [c for c in eviction_order(cands, upcoming) if c.name not in pinned]
    assert evicted == order[: len(evicted)]  # a prefix of the allowed order
    freed = sum(c.size for c in evicted)
    if freed < need:
        assert evicted == order  # short only when nothing else may go
    else:  # and it stops as soon as it has enough
        assert freed - evicted[-1].size < need if evicted else need == 0
