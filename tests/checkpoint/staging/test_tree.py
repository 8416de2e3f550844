"""Flattening a nested state into keyed tensors and rebuilding it: property tests."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.checkpoint.staging.stager import StateStager
from unbroken.checkpoint.staging.tree import collect, rebuild

DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8]

tensors = st.builds(
    lambda shape, dtype, seed: (
        torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        if dtype is torch.bool
        else torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(9).to(dtype)
    ),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.integers(0, 2**16),
)
scalars = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))
states = st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=4),
    st.recursive(
        st.one_of(tensors, scalars),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
        ),
        max_leaves=12,
    ),
    max_size=5,
)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


@given(states)
@settings(max_examples=60, deadline=None)
def test_rebuild_of_collected_tensors_is_the_same_state(state):
    found = collect(state)
    names = [f.name for f in found]
    assert len(names) == len(set(names))
    rebuilt = rebuild(state, iter([f.value.clone() for f in found]))
    assert _equal(state, rebuilt)


@given(states)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_staged_state_equals_the_source(state):
    stager = StateStager(chunk_bytes=64)
    try:
        with stager.stage(state) as staged:
            staged.wait()
            assert _equal(state, staged.state_dict)
    finally:
        stager.close()
