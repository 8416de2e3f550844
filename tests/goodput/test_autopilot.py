"""every_seconds="auto": the Young/Daly interval from measured costs and observed failures."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

import unbroken as ub
from unbroken.goodput import autopilot
from unbroken.goodput.autopilot import Autopilot, auto_interval, estimate_mtbf
from unbroken.goodput.events import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_estimate_starts_at_the_prior_and_grows_without_failures():
    assert estimate_mtbf(0, 0) == autopilot.PRIOR_SECONDS
    assert estimate_mtbf(7200, 0) == 3 * autopilot.PRIOR_SECONDS
    assert estimate_mtbf(7200, 2, prior=0) == 2400
    with pytest.raises(ValueError):
        estimate_mtbf(-1, 0)


def test_the_interval_is_young_daly_but_never_under_the_commit_time():
    assert auto_interval(None, None, 3600) == autopilot.FIRST_INTERVAL
    assert auto_interval(2.0, 1.0, 3600) == pytest.approx(math.sqrt(2 * 2.0 * 3600))
    assert auto_interval(0.001, 30.0, 3600) == 30.0  # saves never queue up
    assert auto_interval(1e-9, None, 10) == autopilot.MIN_INTERVAL


def test_a_saves_cost_counts_the_steps_it_slowed():
    pilot = Autopilot(mtbf=1000)
    for _ in range(10):
        pilot.step(0.1, saving=False)
    for _ in range(4):
        pilot.step(0.15, saving=True)  # 50 ms slower while the save ran in the background
    pilot.saved(0.01)
    pilot.saved(0.03)
    assert pilot.save_cost() == pytest.approx(0.02 + 0.05 * 4 / 2)
    assert pilot.interval() == pytest.approx(math.sqrt(2 * pilot.save_cost() * 1000))


def _loop(mgr: ub.CheckpointManager, steps: int, pause: float) -> None:
    model = torch.nn.Linear(64, 64)
    state = {"model": model}
    for step in range(1, steps + 1):
        model(torch.randn(8, 64)).sum().backward()
        time.sleep(pause)
        mgr.maybe_save(step, state)


def test_auto_saves_at_the_interval_it_chose_and_logs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(autopilot, "FIRST_INTERVAL", 0.05)
    monkeypatch.setattr(autopilot, "MIN_INTERVAL", 0.05)
    mgr = ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st",
                               every_seconds="auto", mtbf=2.0, keep_last=None)  # fmt: skip
    assert mgr.config.every_steps is None  # "auto" sets the cadence by itself
    pilot = mgr._cadence.autopilot
    choices = []  # (the figures it chose from, what it chose); a commit may land after
    choose = pilot.interval

    def recorded() -> float:
        inputs = (pilot.save_cost(), pilot.commit_seconds, pilot.current_mtbf())
        choices.append((inputs, choose()))
        return choices[-1][1]

    monkeypatch.setattr(pilot, "interval", recorded)
    _loop(mgr, 60, 0.01)
    mgr.close()
    assert pilot.saves >= 2 and choices
    (cost, commit, mtbf), chosen = choices[-1]
    assert cost is not None and mtbf == 2.0
    assert chosen == pilot.chosen == pytest.approx(auto_interval(cost, commit, mtbf))
    intervals = [
        e.info["seconds"]
        for by_rank in read_log(ub.open_store(str(tmp_path / "ck"))).values()
        for e in by_rank[0]
        if e.kind == "interval"
    ]
    assert intervals and intervals[-1] > autopilot.FIRST_INTERVAL


def test_auto_counts_the_failures_of_earlier_attempts(tmp_path):
    crash = (
        "import os, sys, torch, unbroken as ub\n"
        "mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], every_steps=2)\n"
        "m = torch.nn.Linear(4, 4)\n"
        "first = (mgr.restore({'model': m}) or 0) + 1\n"
        "for s in range(first, first + 5):\n"
        "    mgr.maybe_save(s, {'model': m})\n"
        "mgr.wait(); import time; time.sleep(1.5)\n"  # the event log's local copy lands
        "os._exit(9)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    args = [str(tmp_path / "ck"), str(tmp_path / "st")]
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", crash, *args], env=env, timeout=120)
        assert proc.returncode == 9
    mgr = ub.CheckpointManager(args[0], staging_dir=args[1], every_seconds="auto")
    pilot = mgr._cadence.autopilot
    mgr.close()
    assert pilot.failures == 2 and pilot.observed_seconds > 0
    assert pilot.current_mtbf() < autopilot.PRIOR_SECONDS  # two failures in seconds


@pytest.mark.parametrize("bad", [{"every_seconds": "sometimes"}, {"every_seconds": True},
                                 {"every_seconds": float("nan")}, {"every_seconds": float("inf")},
                                 {"every_seconds": "auto", "mtbf": 0}, {"mtbf": 3600}])  # fmt: skip
def test_bad_cadence_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match=r"every_seconds|mtbf"):
        ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st", **bad)


def test_an_unknown_option_is_named_with_the_ones_there_are(tmp_path):
    with pytest.raises(TypeError, match=r"unknown options \['bogus_option'\].*every_steps"):
        ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st", bogus_option=1)
