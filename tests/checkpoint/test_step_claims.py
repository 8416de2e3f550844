"""The claim on a step (``step-N/writer.json``): which claims a job takes over (its own
earlier attempts on any host, dead or reused pids on this host), which stop it for good
(another job, provably alive), and which only skip the step with the way out."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import unbroken as ub
from unbroken._util.job import JOB_ID_ENV
from unbroken._util.procs import process_start_ticks
from unbroken.checkpoint.format.manifest import step_dir
from unbroken.checkpoint.format.writers import (
    LIVE,
    OURS,
    STALE,
    UNPROVEN,
    WRITER_NAME,
    claim_step,
    judge_claim,
    writer_identity,
)

from .manager_util import make_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ELSEWHERE = "node-that-is-not-this-one"


@pytest.fixture
def sleeper():
    """A real live process of this host (another job's saver, for the claims below)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def claim(**fields) -> dict:
    return {"host": ELSEWHERE, "pid": 4242, "started": 1.0e9, "ticks": "77", "job": None} | fields


def plant(root: Path, step: int, writer: dict) -> Path:
    path = root / "durable" / step_dir(step) / WRITER_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(writer))
    return path


def manager(root: Path) -> ub.CheckpointManager:
    return ub.CheckpointManager(
        root / "durable", staging_dir=root / "staging", every_steps=1, async_save=False
    )


def committed(root: Path, step: int) -> bool:
    return (root / "durable" / step_dir(step) / "manifest.json").exists()


# -- taken over ------------------------------------------------------------------------


def test_a_claim_an_earlier_attempt_of_this_job_left_on_another_host_is_taken_over(
    tmp_path, monkeypatch
):
    """The job restarted on another node: its last save must not be blocked for ever."""
    monkeypatch.setenv(JOB_ID_ENV, "run-7")
    path = plant(tmp_path, 2, claim(job="run-7"))
    with manager(tmp_path) as mgr:
        assert mgr.save(2, make_state())
    assert committed(tmp_path, 2)
    assert json.loads(path.read_text()) == writer_identity()  # the claim names this job now


def test_a_claim_whose_pid_a_live_process_reuses_is_taken_over(tmp_path, sleeper):
    """Same host, same pid, another start time: the recorded process is gone (a container
    restarted in place, or a busy node reusing pids)."""
    real = process_start_ticks(sleeper.pid)
    assert real is not None
    plant(tmp_path, 2, claim(host=socket.gethostname(), pid=sleeper.pid, ticks=f"{real}0"))
    with manager(tmp_path) as mgr:
        assert mgr.save(2, make_state())
    assert committed(tmp_path, 2) and sleeper.poll() is None


def test_a_claim_of_a_dead_process_on_this_host_is_taken_over(tmp_path, dead_pid):
    plant(tmp_path, 2, claim(host=socket.gethostname(), pid=dead_pid, job="another-job"))
    with manager(tmp_path) as mgr:
        assert mgr.save(2, make_state())
    assert committed(tmp_path, 2)


def test_a_dead_attempts_files_in_a_step_taken_over_are_removed_at_the_commit(tmp_path, dead_pid):
    """A 3-rank attempt killed mid-save, resumed on 2 ranks: the commit kept rank 2's
    shard and RNG state beside the new manifest, unlisted, for as long as the step."""
    plant(tmp_path, 2, claim(host=socket.gethostname(), pid=dead_pid, job="elastic"))
    step = tmp_path / "durable" / step_dir(2)
    (step / "rng").mkdir()
    for stale in ("__0_0.distcp", "__2_0.distcp", "rng/rank-00002.json"):
        (step / stale).write_bytes(b"the dead attempt's")
    with manager(tmp_path) as mgr:
        assert mgr.save(2, make_state())
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()}
    assert on_disk == {f["name"] for f in manifest["files"]} | {"manifest.json", WRITER_NAME}
    assert "__0_0.distcp" in on_disk and "__2_0.distcp" not in on_disk
    with manager(tmp_path) as mgr:
        assert mgr.restore(make_state()) == 2


# -- another job, provably alive: raised from the save that learns of it ---------------


def test_a_live_second_job_is_raised_not_warned_and_its_claim_kept(tmp_path, sleeper):
    ticks = process_start_ticks(sleeper.pid)
    theirs = claim(host=socket.gethostname(), pid=sleeper.pid, ticks=ticks, job="job-B")
    path = plant(tmp_path, 2, theirs)
    with manager(tmp_path) as mgr:
        with pytest.raises(ub.OtherJobError) as info:
            mgr.save(2, make_state())  # raise_on_failure is off: this is never healing
        assert json.loads(path.read_text()) == theirs and not committed(tmp_path, 2)
        assert mgr.save(3, make_state())  # the job may go on if it catches it
    err = info.value
    assert isinstance(err, ub.OtherWriterError) and isinstance(err, ub.SaveFailedError)
    assert f"pid {sleeper.pid}" in err.other_job and "'job-B'" in err.other_job
    assert f"pid {writer_identity()['pid']}" in err.this_job
    assert err.other_job in str(err) and err.this_job in str(err) and err.step == 2
    assert "runs on this host" in str(err)


def test_a_claim_made_on_another_host_after_this_job_looked_proves_another_job(tmp_path):
    """No lease, no pid to check: but a claim that was not there at this job's first look
    was made by a writer alive since."""
    with manager(tmp_path) as mgr:
        assert mgr.save(1, make_state())  # the first look at the URL
        plant(tmp_path, 2, claim(job="job-B"))
        with pytest.raises(ub.OtherJobError, match="made after this job first looked"):
            mgr.save(2, make_state())
    assert not committed(tmp_path, 2)


# -- cannot tell: the step is skipped, with the way out ---------------------------------


@pytest.mark.parametrize("their_job", [None, "job-B"])
def test_an_old_claim_on_another_host_skips_the_step_and_says_how_to_free_it(
    tmp_path, monkeypatch, their_job
):
    monkeypatch.delenv(JOB_ID_ENV, raising=False)
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if their_job is not None:
        monkeypatch.setenv(JOB_ID_ENV, "job-A")
    path = plant(tmp_path, 2, claim(job=their_job))
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert not mgr.save(2, make_state())
        assert path.exists() and not committed(tmp_path, 2)
        assert mgr.save(3, make_state())  # only that step is skipped
    (told,) = [str(w.message) for w in record if WRITER_NAME in str(w.message)]
    assert f"host {ELSEWHERE} pid 4242" in told and f"delete {path}" in told
    assert (JOB_ID_ENV in told) == (their_job is None), told
    assert committed(tmp_path, 3)


# -- the verdicts themselves -----------------------------------------------------------


def test_judge_claim(sleeper, dead_pid, monkeypatch):
    monkeypatch.setenv(JOB_ID_ENV, "job-A")
    mine = writer_identity()
    here, ticks = socket.gethostname(), process_start_ticks(sleeper.pid)
    assert judge_claim(dict(mine), mine) == OURS
    assert judge_claim(claim(job="job-A"), mine) == STALE
    assert judge_claim(claim(job="job-B"), mine) == UNPROVEN
    assert judge_claim(claim(), mine) == UNPROVEN
    assert judge_claim("not a claim", mine) == UNPROVEN
    assert judge_claim(claim(host=here, pid=dead_pid), mine) == STALE
    assert judge_claim(claim(host=here, pid=sleeper.pid, ticks=ticks), mine) == LIVE
    assert judge_claim(claim(host=here, pid=sleeper.pid, ticks=ticks, job="job-A"), mine) == LIVE
    assert judge_claim(claim(host=here, pid=sleeper.pid, ticks=f"{ticks}1"), mine) == STALE
    assert judge_claim(claim(host=here, pid=sleeper.pid, ticks=None), mine) == LIVE  # older
    assert judge_claim(dict(mine, started=0.0), mine) == STALE  # the pid's earlier process


def test_a_stale_claim_in_a_committed_step_is_not_taken_over(tmp_path, dead_pid):
    """A coordinator whose view of the URL is stale must not upload over a commit."""
    store = ub.open_store(tmp_path / "durable")
    plant(tmp_path, 5, claim(host=socket.gethostname(), pid=dead_pid))
    store.write_bytes(f"{step_dir(5)}/manifest.json", b"{}")
    with pytest.raises(ub.OtherWriterError, match="already committed"):
        claim_step(store, step_dir(5), 5)
