"""A save behind the URL's newest committed step is refused, never kept for a moment.

Retention keeps the newest steps: a run that starts on a URL holding step 100 without
``restore`` (or whose step counter went back) had each save commit, then removed at once,
and a restart loaded step 100, another run's progress. The ranks' own disagreement on the
step is in ``dist_scenarios.scenario_retention``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken as ub
from unbroken.checkpoint.format.manifest import step_dir

from .manager_util import assert_same, flip_payload_byte, make_state, snapshot, train


def manager(tmp_path: Path, **kw) -> ub.CheckpointManager:
    kw.setdefault("memory_tier", False)
    return ub.CheckpointManager(
        str(tmp_path / "durable"), staging_dir=str(tmp_path / "staging"), **kw
    )


def committed(mgr: ub.CheckpointManager) -> list[int]:
    return [c.step for c in mgr.checkpoints() if c.committed]


def test_a_run_that_starts_behind_the_urls_newest_is_refused_and_the_newest_kept(tmp_path):
    state = make_state()
    with manager(tmp_path, keep_last=None) as first:
        train(state, range(1, 3))
        first.save(10, state)
        first.save(100, state)
    newest = snapshot(state)
    other = make_state(7)
    mgr = manager(tmp_path, keep_last=1)  # no restore: the user forgot it
    mgr.save(10, other)  # a step the old run kept too: refused as behind, not warned about
    with pytest.raises(ub.StepBehindError, match="step 10 is older than step 100") as info:
        mgr.wait()
    assert info.value.newest == 100 and "restore(state)" in str(info.value)
    # raise_on_failure is off, yet the next maybe_save raises: every later save would fail
    mgr.save(20, other)
    deadline = time.monotonic() + 60
    while len(mgr.failures) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(ub.StepBehindError, match="step 20 is older than step 100"):
        mgr.maybe_save(21, other)
    assert committed(mgr) == [10, 100]
    mgr.close()
    fresh = make_state(3)
    with manager(tmp_path) as again:
        assert again.restore(fresh) == 100
    assert_same(snapshot(fresh), newest)


def test_a_step_that_goes_back_within_a_run_is_refused_at_once(tmp_path):
    state = make_state()
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(5, state)
        mgr.wait()
        for older in (3, 4):  # 4: once refused, not skipped as "committed" either
            with pytest.raises(ub.StepBehindError, match=f"step {older} is older than step 5, "
                               "which this run saved"):  # fmt: skip
                mgr.save(older, state)
        assert committed(mgr) == [5] and mgr.stats.skipped_committed == 0
        assert not mgr.save(5, state)  # the same step: skipped, as ever
        mgr.save(6, state)  # forward again: saved as usual
        mgr.wait()
        assert committed(mgr) == [6]


def test_a_step_counted_per_epoch_is_refused_at_the_first_step_of_the_next_epoch(tmp_path):
    """Epoch 1's steps 4 and 8 were committed by epoch 0 already: they were skipped as
    "already saved", nothing after epoch 0 was ever saved, and a restart lost the rest."""
    state = make_state()
    with manager(tmp_path, every_steps=4) as mgr:
        for step in range(1, 11):
            if mgr.maybe_save(step, state):
                mgr.wait()  # epoch 0's commits land: the old skip came from them
        with pytest.raises(ub.StepBehindError, match="step 1 is older than step 8, which this "
                           r"run saved .* not per epoch") as info:  # fmt: skip
            mgr.maybe_save(1, state)  # not even a due step: at once
        assert (info.value.step, info.value.newest) == (1, 8)
        assert committed(mgr) == [4, 8]


def test_a_step_behind_the_restored_one_is_refused_at_once(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(8, state)
    with manager(tmp_path, every_steps=4) as mgr:
        assert mgr.restore(state) == 8
        assert not mgr.maybe_save(8, state)  # the restored step: already saved
        with pytest.raises(ub.StepBehindError, match="step 4 is older than step 8, which "
                           "this run restored"):  # fmt: skip
            mgr.maybe_save(4, state)  # the loop started over at 0 after the restore
        assert mgr.maybe_save(12, state)


def test_a_run_whose_first_save_is_the_urls_newest_step_is_refused_not_warned(tmp_path):
    """Without restore, a first save at the step the URL already holds was a warning
    ("never overwritten"), and the run's next saves committed among the old run's."""
    state = make_state()
    with manager(tmp_path) as first:
        first.save(6, state)
    kept = (tmp_path / "durable" / step_dir(6) / "manifest.json").read_bytes()
    mgr = manager(tmp_path)  # default options: a refusal is raised all the same
    mgr.save(6, make_state(7))
    with pytest.raises(ub.StepBehindError, match=r"step 6 is already committed at .* this run "
                       r"did not restore it") as info:  # fmt: skip
        mgr.wait()
    assert "call restore(state)" in str(info.value) and info.value.newest == 6
    assert committed(mgr) == [6]
    mgr.close()
    assert (tmp_path / "durable" / step_dir(6) / "manifest.json").read_bytes() == kept


def test_a_run_restored_past_an_unusable_newest_saves_behind_it(tmp_path):
    """Restore went past step 4 (corrupt) to step 2: steps 3 on are this run's, and a
    restart will go past step 4 again to load them."""
    state = make_state()
    with manager(tmp_path, keep_last=3) as mgr:
        for step in (2, 4):
            train(state, range(step - 1, step + 1))
            mgr.save(step, state)
            mgr.wait()
    for tier in ("durable", "staging"):
        flip_payload_byte(tmp_path / tier / step_dir(4))
    fresh = make_state(5)
    with manager(tmp_path, keep_last=3) as mgr:
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert mgr.restore(fresh) == 2
        train(fresh, range(3, 4))
        mgr.save(3, fresh)
        mgr.wait()
        assert committed(mgr) == [2, 3, 4]
        saved = snapshot(fresh)
    again = make_state(6)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning, match="falling back"):
        assert mgr.restore(again) == 3
    assert_same(snapshot(again), saved)


def test_the_step_restore_went_past_does_not_crowd_out_the_runs_own(tmp_path):
    """keep_last=1 counted the corrupt step 20 as the newest: the run's step 13 was
    deleted as soon as it committed, and every restart went back to step 10."""
    state = make_state()
    kw = {"keep_last": 1, "keep_every_steps": 10}
    with manager(tmp_path, **kw) as mgr:
        for step in (10, 20):
            mgr.save(step, state)
            mgr.wait()
    for tier in ("durable", "staging"):
        flip_payload_byte(tmp_path / tier / step_dir(20))
    with manager(tmp_path, **kw) as mgr:
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert mgr.restore(state) == 10
        train(state, range(11, 14))
        mgr.save(13, state)
        mgr.wait()
        assert committed(mgr) == [10, 13, 20]  # 20 kept to be looked at, never counted
        saved = snapshot(state)
    again = make_state(6)
    with manager(tmp_path, **kw) as mgr, pytest.warns(RuntimeWarning, match="falling back"):
        assert mgr.restore(again) == 13
    assert_same(snapshot(again), saved)


class _Tracker:
    """A metric tracker whose state_dict holds a numpy scalar (common: np.min of losses)."""

    def __init__(self) -> None:
        self.best = np.float32(np.inf)

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, sd: dict) -> None:
        self.best = sd["best"]


def test_a_value_inside_an_object_that_cannot_load_back_is_refused_at_the_save(tmp_path):
    """Every save of it failed in the background and was only warned about: a job with
    default options trained on with nothing committed."""
    state = {**make_state(), "tracker": _Tracker()}
    with manager(tmp_path, every_steps=1) as mgr:
        with pytest.raises(TypeError, match=r"item .tracker.best. is a numpy.float32, "
                           r"which a checkpoint cannot give back .*value.item\(\)"):  # fmt: skip
            mgr.maybe_save(1, state)
        assert mgr.stats.started == 0
        state["tracker"].best = float(state["tracker"].best)  # the fix the message names
        assert mgr.maybe_save(2, state)
        mgr.wait()
        assert committed(mgr) == [2]


def test_a_sparse_tensor_is_refused_with_the_way_out(tmp_path):
    with manager(tmp_path) as mgr, pytest.raises(TypeError, match=r"to_dense\(\)"):
        mgr.save(1, {"t": torch.eye(3).to_sparse()})
