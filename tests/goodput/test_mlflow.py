"""MLflow: rank 0 logs the loop's figures by itself, to one run across restarts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import unbroken as ub
from unbroken.goodput import events as ev
from unbroken.goodput.breakdown import breakdown
from unbroken.goodput.mlflow_sink import METRICS, RUN_KEY

from .helpers import JOB, env, goodput_json, make_volume, train

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


def saved_run(url: str) -> str:
    return json.loads(ub.open_store(url).read_bytes(RUN_KEY))["run_id"]


def test_a_sqlite_tracking_uri_gets_every_metric(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()  # the database exists (migrated)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("UNBROKEN_MLFLOW_EVERY_STEPS", "2")
    url = str(tmp_path / "ck")
    train(tmp_path, url, every_steps=3, step_seconds=0.2)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(saved_run(url))
    assert run.info.status == "FINISHED"
    # every metric but the autopilot's interval (this loop saves every 3 steps)
    assert set(run.data.metrics) == set(METRICS) - {"checkpoint_interval_seconds"}
    goodput = client.get_metric_history(run.info.run_id, "goodput")
    assert len(goodput) >= 2  # batched along the way, not only at the end
    assert all(0 < m.value <= 1 for m in goodput)
    assert max(m.step for m in goodput) == 8
    assert run.data.metrics["cache_hit_ratio"] == 0.0  # each file read once: all misses
    assert run.data.metrics["checkpoint_commit_seconds"] > 0
    # the same figure as the report: the START (startup) counts (a hostile user's find:
    # it was flushed before the sink kept the history, and 0.997 was logged for 0.548)
    last = max(goodput, key=lambda m: m.step).value
    assert last == pytest.approx(goodput_json(url)["goodput"], abs=0.005)


def test_a_batch_with_no_new_step_logs_no_per_step_figure(tmp_path, monkeypatch):
    """The closing batch often follows a periodic one at the same step: it logged
    ``fetch_seconds = 0`` there, an average over no step."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("UNBROKEN_MLFLOW_EVERY_STEPS", "1000")  # only the calls below log
    model = torch.nn.Linear(4, 2)
    with ub.CheckpointManager(str(tmp_path / "ck"), every_steps=100) as mgr:
        for step in range(1, 4):
            time.sleep(0.05)
            mgr.maybe_save(step, {"model": model})
        sink = mgr._goodput.sink
        deadline = time.monotonic() + 60
        while sink.run_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        sink.log_now()
        sink.log_now()
        client = MlflowClient(tracking_uri=uri)
        fetch = client.get_metric_history(sink.run_id, "fetch_seconds")
        assert [m.step for m in fetch] == [3], [(m.step, m.value) for m in fetch]
        assert [m.step for m in client.get_metric_history(sink.run_id, "goodput")] == [3, 3]


def test_a_long_run_keeps_its_running_goodput_in_a_few_events(tmp_path, monkeypatch):
    """A longevity run's find: the sink kept every event of the attempt (about 0.8 KB of
    rank 0's memory per step) and recomputed the goodput over all of them (3.1 s of CPU
    at 400,000 events)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    model = torch.nn.Linear(4, 2)
    with ub.CheckpointManager(str(tmp_path / "ck"), every_steps=1000) as mgr:
        sink, log = mgr._goodput.sink, mgr._goodput.log
        deadline = time.monotonic() + 60
        while sink._running is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for step in range(1, 3001):
            mgr.maybe_save(step, {"model": model})
        mgr.wait()  # no COMMIT event after the comparison's moment
        log.flush(durable=False)
        assert len(log.history) < 30, log.history.events()[:40]
        # the same figure as the breakdown of every event this attempt wrote
        now = ev.Event(ev.BEAT, mgr._goodput.now())
        every = ev.parse_lines(Path(log.local_path).read_text(), log.local_path)
        want = breakdown({sink.attempt: [*every, now]}).goodput
        got = sink._running.goodput([*log.events_so_far(), now], mgr._goodput.last_step)
        # the file rounds each time to a microsecond (exactness: test_running.py)
        assert got == pytest.approx(want, abs=1e-4)


def test_an_active_run_is_logged_to_and_left_open(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run() as run:
            url = str(tmp_path / "ck")
            train(tmp_path, url, every_steps=3, step_seconds=0.2)
            assert saved_run(url) == run.info.run_id
            assert MlflowClient(uri).get_run(run.info.run_id).info.status == "RUNNING"
        assert "goodput" in MlflowClient(uri).get_run(run.info.run_id).data.metrics
    finally:
        mlflow.set_tracking_uri(None)


def test_switched_off_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("UNBROKEN_MLFLOW", "0")
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    assert not ub.open_store(str(tmp_path / "ck")).exists(RUN_KEY)


def test_a_run_opened_then_a_failure_is_still_logged_to_and_finished(tmp_path, monkeypatch):
    """A later reviewer's find: a failure after the run was made (here its tag; also the
    durable tier refusing mlflow-run.json once) left the run RUNNING with no metric."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("UNBROKEN_MLFLOW_EVERY_STEPS", "2")

    def refuse(*args, **kwargs):
        raise RuntimeError("tagging refused")

    monkeypatch.setattr(MlflowClient, "set_tag", refuse)
    url = str(tmp_path / "ck")
    train(tmp_path, url, every_steps=3)
    run = MlflowClient(tracking_uri=uri).get_run(saved_run(url))
    assert run.info.status == "FINISHED" and "goodput" in run.data.metrics


def test_a_server_that_never_answers_does_not_hold_the_jobs_end(tmp_path, monkeypatch, caplog):
    """A hostile user's find: with the tracking server hung, close() waited 60 s with no
    word (past a preemption's 30 s grace), and the metrics were silently missing."""
    import unbroken.goodput.mlflow_sink as sink

    monkeypatch.setattr(sink, "CLOSE_SECONDS", 1.0, raising=False)
    with socket.socket() as hung:  # listens, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{hung.getsockname()[1]}")
        with (
            caplog.at_level("WARNING", logger="unbroken.goodput.mlflow_sink"),
            ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr,
        ):
            mgr.save(1, {"w": torch.zeros(2)})
    assert "did not answer within 1 s" in caplog.text, caplog.text
    assert ub.open_store(str(tmp_path / "ck")).exists("step-000000000001/manifest.json")


@pytest.fixture
def mlflow_server(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
        "--default-artifact-root", str(tmp_path / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("mlflow server did not start: " + (tmp_path / "server.log").read_text())
        time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 9)
    proc.wait()
    log.close()


@pytest.mark.slow  # about a minute here, most of it the server's start
@pytest.mark.multiprocess
def test_a_restarted_attempt_logs_to_the_same_run_on_a_real_server(tmp_path, mlflow_server):
    data = make_volume(tmp_path / "data")
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    job_env = {**env(), "MLFLOW_TRACKING_URI": mlflow_server, "UNBROKEN_MLFLOW_EVERY_STEPS": "5"}
    args = [
        sys.executable,
        str(JOB),
        "--url",
        url,
        "--staging",
        staging,
        "--data",
        data,
        "--step-seconds",
        "0.3",
    ]  # fmt: skip  (the run opens before the kill)
    first = subprocess.run([*args, "--crash-at", "25"], env=job_env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert first.returncode == -9, first.stderr
    run_id = saved_run(url)
    second = subprocess.run(args, env=job_env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert saved_run(url) == run_id
    client = MlflowClient(tracking_uri=mlflow_server)
    assert [r.info.run_id for r in client.search_runs(["0"])] == [run_id]
    steps = [m.step for m in client.get_metric_history(run_id, "goodput")]
    assert min(steps) <= 25 and max(steps) == 40  # both attempts, one run
    fetch = client.get_metric_history(run_id, "fetch_seconds")
    assert fetch and all(m.value >= 0 for m in fetch)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_another_job_on_the_same_root_gets_a_run_of_its_own(tmp_path, monkeypatch):
    """`unbroken goodput` counts a second launch as another job: so does MLflow (it
    logged into the first job's run, and set that FINISHED run RUNNING again)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    url = str(tmp_path / "ck")
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-a")
    train(tmp_path, url, every_steps=3, step_seconds=0.05)
    first = saved_run(url)
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-b")
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st2") as mgr:  # a job of its own
        mgr.save(100, {"w": torch.zeros(2)})
    second = saved_run(url)
    client = MlflowClient(tracking_uri=uri)
    assert second != first
    assert client.get_run(first).info.status == "FINISHED"
    tags = [client.get_run(run).data.tags["unbroken.attempt"] for run in (first, second)]
    assert tags[0] != tags[1]


def test_a_run_created_by_an_attempt_killed_before_recording_it_is_found_again(
    tmp_path, monkeypatch
):
    """An attempt killed while create_run waited for a slow server's answer left a run
    it never recorded: the next attempt opened a second one, and the first stayed
    RUNNING, empty, for ever. Its tags (the job, the root) find it again."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-a")
    url = str(tmp_path / "ck")
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    orphan = saved_run(url)
    client = MlflowClient(tracking_uri=uri)
    client.update_run(orphan, status="RUNNING")  # the killed attempt never ended it...
    ub.open_store(url).delete(RUN_KEY)  # ...nor recorded it
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-b")  # another job on the root: its own run
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st") as mgr:
        mgr.save(2, {"w": torch.zeros(2)})
    other = saved_run(url)
    assert other != orphan
    ub.open_store(url).delete(RUN_KEY)
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-a")  # the killed job's next attempt
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st") as mgr:
        mgr.save(3, {"w": torch.zeros(2)})
    assert saved_run(url) == orphan
    assert len(client.search_runs(["0"])) == 2
    assert client.get_run(orphan).info.status == "FINISHED"


def test_a_preempted_attempts_run_stays_running_for_the_restart(tmp_path, monkeypatch):
    """A preempted attempt is not the job's end: its run was marked FINISHED, then
    RUNNING again by the restart, and FINISHED for good if the job was never resumed."""
    import signal

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    url, state = str(tmp_path / "ck"), {"w": torch.ones(4)}
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with ub.CheckpointManager(url, staging_dir=tmp_path / "st", preemption="flag") as mgr:
            os.kill(os.getpid(), signal.SIGTERM)
            assert mgr.maybe_save(1, state) and mgr.preempted
    finally:
        signal.signal(signal.SIGTERM, previous)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(saved_run(url)).info.status == "RUNNING"
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st") as mgr:  # the restart
        assert mgr.restore(state) == 1
        mgr.save(2, state)
    assert client.get_run(saved_run(url)).info.status == "FINISHED"
