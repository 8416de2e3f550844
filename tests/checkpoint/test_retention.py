"""Retention is a pure function; its guarantees hold for every catalog (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.checkpoint.catalog import CheckpointInfo
from unbroken.checkpoint.retention import plan_deletions


def info(step: int, committed: bool, newer_format: bool = False) -> CheckpointInfo:
    return CheckpointInfo(step, committed, 0, None, None, f"mem://x/{step}", None, newer_format)


KINDS = {"committed": (True, False), "partial": (False, False), "newer format": (False, True)}
catalogs = st.dictionaries(st.integers(0, 200), st.sampled_from(sorted(KINDS)), max_size=25).map(
    lambda d: [info(s, *KINDS[kind]) for s, kind in sorted(d.items())]
)
keep_last = st.one_of(st.none(), st.integers(1, 8))
keep_every = st.one_of(st.none(), st.integers(1, 50))


@settings(max_examples=300, deadline=None)
@given(catalogs, keep_last, keep_every)
def test_guarantees(cps, last, every):
    doomed = plan_deletions(cps, keep_last=last, keep_every_steps=every)
    steps = {c.step for c in cps}
    committed = sorted(c.step for c in cps if c.committed)
    assert doomed == sorted(set(doomed)) and set(doomed) <= steps
    if not committed:
        assert doomed == []  # nothing is deleted unless a checkpoint is committed
        return
    newest = committed[-1]
    assert all(s < newest for s in doomed)  # never the newest committed, nor in-flight ones
    kept = [s for s in committed if s not in doomed]
    if last is not None:
        assert kept[-min(last, len(committed)) :] == committed[-min(last, len(committed)) :]
        if every is None:
            assert len(kept) == min(last, len(committed))
    else:
        assert kept == committed
    if every is not None:
        assert all(s in kept for s in committed if s % every == 0)
    newer = {c.step for c in cps if c.newer_format}
    assert not newer & set(doomed)  # what a newer unbroken committed is never deleted
    partial_old = {c.step for c in cps if not c.committed and c.step < newest} - newer
    assert partial_old <= set(doomed)  # debris of crashed saves goes
    assert all(c.step in doomed or c.committed or c.step in newer or c.step > newest for c in cps)


@settings(max_examples=200, deadline=None)
@given(catalogs, keep_last, keep_every)
def test_idempotent(cps, last, every):
    doomed = set(plan_deletions(cps, keep_last=last, keep_every_steps=every))
    rest = [c for c in cps if c.step not in doomed]
    assert plan_deletions(rest, keep_last=last, keep_every_steps=every) == []


@settings(max_examples=200, deadline=None)
@given(catalogs, st.integers(1, 8), keep_every)
def test_keeping_more_never_deletes_more(cps, last, every):
    fewer = set(plan_deletions(cps, keep_last=last + 1, keep_every_steps=every))
    assert fewer <= set(plan_deletions(cps, keep_last=last, keep_every_steps=every))


def test_examples():
    cps = [info(s, True) for s in (100, 200, 300, 400, 500)] + [info(250, False), info(600, False)]
    assert plan_deletions(cps, keep_last=2, keep_every_steps=None) == [100, 200, 250, 300]
    assert plan_deletions(cps, keep_last=1, keep_every_steps=200) == [100, 250, 300]
    assert plan_deletions(cps, keep_last=None, keep_every_steps=None) == [250]
    newer = [*cps, info(150, False, newer_format=True)]
    assert plan_deletions(newer, keep_last=2, keep_every_steps=None) == [100, 200, 250, 300]


def test_a_step_restore_went_past_is_kept_and_never_counted():
    """Restore went past step 20 (corrupt) to 10; the run saved 13: with keep_last=1,
    counting 20 as the newest deleted 13 the moment it committed."""
    cps = [info(s, True) for s in (10, 13, 20)] + [info(12, False), info(15, False)]
    assert plan_deletions(cps, keep_last=1, keep_every_steps=10) == [12, 13, 15]  # as it was
    assert plan_deletions(cps, keep_last=1, keep_every_steps=10, passed_over={20}) == [12]
    assert plan_deletions(cps, keep_last=1, keep_every_steps=None, passed_over={20}) == [10, 12]
    # every committed step passed over (the run saved none yet): as without it
    only = [info(20, True), info(12, False)]
    assert plan_deletions(only, keep_last=1, keep_every_steps=None, passed_over={20}) == [12]


@pytest.mark.parametrize("kw", [{"keep_last": 0}, {"keep_every_steps": 0}, {"keep_last": -1}])
def test_bad_settings_are_refused(kw):
    args = {"keep_last": None, "keep_every_steps": None, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        plan_deletions([info(1, True)], **args)
