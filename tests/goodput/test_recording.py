"""The manager and the loader record goodput by themselves: no code in the loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import unbroken as ub
from unbroken.goodput import events as ev
from unbroken.goodput.breakdown import CATEGORIES, job_breakdown

from .helpers import JOB, env, goodput_json, make_volume, train


def test_a_loop_with_no_goodput_code_is_accounted(tmp_path):
    url = str(tmp_path / "ck")
    train(tmp_path, url, every_steps=4)
    log = ev.read_log(ub.open_store(url))
    b = job_breakdown(log)
    assert b.steps == 8 and b.restarts == 0 and b.attempts[0].clean
    assert b.seconds["data_wait"] > 0 and b.seconds["checkpoint_save"] > 0
    assert b.seconds["startup"] > 0 and b.seconds["productive"] > 0
    assert sum(b.seconds.values()) == pytest.approx(b.wall_seconds)
    kinds = [e.kind for e in log[next(iter(log))][0]]
    assert kinds[0] == ev.START and ev.END in kinds and ev.COMMIT in kinds
    assert not os.path.exists(tmp_path / "st" / ev.PREFIX)  # clean end: local copy gone


def test_recording_switched_off_writes_nothing(tmp_path, monkeypatch):
    state = {"w": torch.zeros(3)}
    with ub.CheckpointManager(tmp_path / "a", staging_dir=tmp_path / "sa", goodput=False) as m:
        m.save(1, state)
    monkeypatch.setenv("UNBROKEN_GOODPUT", "0")
    with ub.CheckpointManager(tmp_path / "b", staging_dir=tmp_path / "sb") as m:
        m.save(1, state)
    for d in ("a", "b", "sa", "sb"):
        assert ev.PREFIX not in os.listdir(tmp_path / d)


@pytest.mark.multiprocess
def test_a_killed_job_and_its_restart_count_the_restart_and_the_redone_steps(tmp_path):
    data = make_volume(tmp_path / "data")
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    args = [sys.executable, str(JOB), "--url", url, "--staging", staging, "--data", data]
    slow_flush = {**env(), "UNBROKEN_GOODPUT_FLUSH": "600"}  # the tail stays local
    first = subprocess.run(
        [*args, "--crash-at", "25"], env=slow_flush, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == -9, first.stderr
    second = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    plot = tmp_path / "timeline.png"
    report = goodput_json(url, "--plot", str(plot))
    assert report["restarts"] == 1
    assert report["wasted_steps"] == 5  # steps 21..25 ran twice (restored at 20)
    assert report["steps"] == 25 + 20
    first_att, second_att = report["attempts"]
    assert not first_att["clean"] and second_att["clean"]
    assert first_att["last_step"] == 25 and second_att["restored_step"] == 20
    secs = report["seconds"]
    assert set(secs) == set(CATEGORIES)
    assert sum(secs.values()) == pytest.approx(report["wall_seconds"])
    assert secs["wasted"] > 0 and secs["down"] > 0 and secs["checkpoint_restore"] > 0
    assert report["goodput"] == pytest.approx(secs["productive"] / report["wall_seconds"])
    assert plot.stat().st_size > 0


@pytest.mark.multiprocess
def test_a_two_rank_job_under_torchrun_counts_its_restart_and_redone_steps(tmp_path):
    from tests.checkpoint.distributed import check, torchrun

    data = make_volume(tmp_path / "data")
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    out = torchrun(
        2,
        *("--url", url, "--staging", staging, "--data", data, "--crash-at", "25"),
        script=JOB,
        max_restarts=1,
        timeout=300,
        env={"UNBROKEN_GOODPUT_FLUSH": "600"},  # the first attempt's tail stays local
    )
    check(out)
    log = ev.read_log(ub.open_store(url))
    assert len(log) == 2 and all(set(ranks) == {0, 1} for ranks in log.values())
    for rank in (0, 1):
        b = job_breakdown(log, rank)
        assert b.restarts == 1 and b.wasted_steps == 5, (rank, b.as_dict())
        assert b.attempts[1].restored_step == 20 and b.attempts[1].clean
    for rank in (0, 1):
        report = goodput_json(url, "--rank", str(rank))
        assert report["restarts"] == 1 and report["wasted_steps"] == 5
        assert report["rank"] == rank


@pytest.mark.multiprocess
def test_an_attempt_killed_at_its_first_step_counts_from_its_process_start(tmp_path):
    """Rank 0 of a 2-rank job is SIGKILLed at once after restore in the first attempt and
    after step 20 in the second: 2 restarts, the wall from the first process start."""
    from tests.checkpoint.distributed import check, torchrun

    data = make_volume(tmp_path / "data")
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    launched = time.time()
    out = torchrun(
        2,
        *("--url", url, "--staging", staging, "--data", data),
        *("--crash-at", "0,20", "--crash-rank", "0"),
        script=JOB,
        max_restarts=2,
        timeout=300,
    )
    check(out)
    job = goodput_json(url)  # each attempt as the rank that got furthest tells it
    assert job["restarts"] == 2 and job["wall_seconds"] > 0, job
    assert [a["clean"] for a in job["attempts"]] == [False, False, True], job
    report = goodput_json(url, "--rank", "0")
    assert report["restarts"] == 2, report
    first, second, third = report["attempts"]
    assert first["steps"] == 0 and not first["clean"]
    assert first["stand_in_rank"] is None  # rank 0's own START, from its first moment
    assert first["seconds"]["startup"] > 0  # it lived at least until its recorder started
    assert second["last_step"] == 20 and not second["clean"]
    assert third["restored_step"] == 20 and third["clean"] and third["last_step"] == 40
    assert launched <= first["start"] < second["start"] < third["start"]
    assert report["wall_seconds"] == pytest.approx(third["end"] - first["start"])
    assert report["seconds"]["down"] > 0


@pytest.mark.parametrize("value", ["abc", "-5", "nan", " 1s "])
def test_a_typo_in_the_flush_setting_is_warned_about_not_fatal(monkeypatch, caplog, value):
    """A hostile user's find: UNBROKEN_GOODPUT_FLUSH=abc killed CheckpointManager() with a
    bare "could not convert string to float" that named no variable."""
    from unbroken.goodput.recorder import _durable_seconds

    monkeypatch.setenv("UNBROKEN_GOODPUT_FLUSH", value)
    assert _durable_seconds(1) == float("inf") and not caplog.text  # said once, by rank 0
    assert _durable_seconds(0) == 60.0
    assert f"UNBROKEN_GOODPUT_FLUSH={value.strip()!r} is not a number" in caplog.text
    for good, seconds in (("2.5", 2.5), ("0", 0.0), ("  ", float("inf"))):  # 0: every tick
        monkeypatch.setenv("UNBROKEN_GOODPUT_FLUSH", good)
        assert _durable_seconds(1) == seconds


UNANSWERED_STORE = """
import glob, os, socket, sys, time
import unbroken as ub
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)  # takes connections, answers nothing: a hung endpoint, a black hole
port = listener.getsockname()[1]
options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{port}"}
mgr = ub.CheckpointManager("s3://bucket/run", staging_dir=sys.argv[1], storage_options=options)
local = glob.glob(os.path.join(sys.argv[1], "_goodput", "*.jsonl"))
print("made", [open(p).read().count('"start"') for p in local], flush=True)
os._exit(0)  # close() would wait for the store, as it does for a save
"""


def test_a_store_that_does_not_answer_does_not_hold_the_managers_construction(tmp_path):
    """The START went to the durable tier inside CheckpointManager(): against an endpoint
    that never answers, the constructor rode out the write's retries for 5 minutes with
    nothing said. The START is on the node's disk at once; the thread sends it on. (With
    MLflow on, rank 0's sink waited for that send in the constructor too.)"""
    mlflow = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri()}
    out = subprocess.run(
        [sys.executable, "-c", UNANSWERED_STORE, str(tmp_path / "staging")],
        capture_output=True, text=True, timeout=120, env={**os.environ, **mlflow},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "made [1]", out.stdout


def slow_decode(data: bytes, path: str) -> torch.Tensor:
    time.sleep(0.01)
    return torch.tensor(list(data[:4]), dtype=torch.float32)


def test_two_managers_in_one_process_each_count_the_loops_data_wait(tmp_path):
    """A model's manager and an EMA's: the loader told only the newest manager of its
    waits, so the other's figure counted them as productive time."""
    volume = make_volume(tmp_path / "vol")
    dataset = ub.VolumeDataset(volume, decode=slow_decode, cache_dir=str(tmp_path / "cache"))
    loader = ub.DataLoader(dataset, batch_size=2)
    urls = [str(tmp_path / "model"), str(tmp_path / "ema")]
    with (
        ub.CheckpointManager(urls[0], staging_dir=tmp_path / "s0") as model_mgr,
        ub.CheckpointManager(urls[1], staging_dir=tmp_path / "s1") as ema_mgr,
    ):
        for step, _ in enumerate(loader, start=1):
            model_mgr.maybe_save(step, {"w": torch.ones(2)})
            ema_mgr.maybe_save(step, {"ema": torch.ones(2)})
    waits = [job_breakdown(ev.read_log(ub.open_store(u))).seconds["data_wait"] for u in urls]
    assert waits[0] > 0.1 and waits[0] == pytest.approx(waits[1], rel=0.2), waits


def test_a_close_that_raises_is_a_crash_and_its_rerun_a_restart(tmp_path):
    """close() raising SaveFailedError (the last save failed, none committed after it)
    ends the process with a traceback: it was counted a clean end, so the rerun was a new
    run and the time between them was not counted at all."""
    switch = tmp_path / "outage"
    url = "emulated::" + str(tmp_path / "durable")
    kw = {
        "staging_dir": tmp_path / "st",
        "memory_tier": False,
        "storage_options": {"latency": 0, "bandwidth": None, "outage_file": str(switch)},
        "retry": ub.RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01),
    }
    state = {"w": torch.ones(4)}
    mgr = ub.CheckpointManager(url, **kw)
    mgr.save(2, state)
    mgr.wait()
    switch.write_text("down")
    mgr.save(4, state)
    mgr._pipeline.wait()  # step 4 failed; the store is back before close() reports it
    switch.unlink()
    with pytest.raises(ub.SaveFailedError, match="step 4"):
        mgr.close()
    time.sleep(0.5)  # the rerun comes later: down time
    with ub.CheckpointManager(url, **kw) as again:
        assert again.restore(state) == 2
        again.save(4, state)
    b = job_breakdown(ev.read_log(ub.open_store(url)))
    assert b.restarts == 1 and b.runs == 1, b
    assert not b.attempts[0].clean and b.attempts[1].clean
    assert b.seconds["down"] >= 0.5
