"""A script that ends without close() keeps its saves; a crash is counted as a crash."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import unbroken as ub

from .distributed import ROOT, free_port, rank_env

_JOB = """
import sys, time, torch, unbroken as ub
url, staging, how = sys.argv[1], sys.argv[2], sys.argv[3]
model = torch.nn.Linear(1024, 1024)  # 4 MB: its save is still in flight at the end
state = {"model": model}
if how == "with":
    with ub.CheckpointManager(url, staging_dir=staging, every_steps=5) as mgr:
        start = mgr.restore(state) or 0
        for step in range(start + 1, 11):
            time.sleep(0.05)
            if step == 8 and start == 0:
                raise RuntimeError("NaN loss at step 8")
            mgr.maybe_save(step, state)
    sys.exit(0)
mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=5)
start = mgr.restore(state) or 0
for step in range(start + 1, start + 6):
    time.sleep(0.05)
    mgr.maybe_save(step, state)
if how == "raise":
    raise RuntimeError("a bug after the save of step %d" % step)
print("loop done, no close()")
"""


def _run(tmp_path, how: str, url: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    cmd = [sys.executable, str(script), url, str(tmp_path / "staging"), how]
    return subprocess.run(
        cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300
    )


def _goodput(url: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "goodput", url, "--json"],
        env=rank_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_script_that_never_calls_close_keeps_the_save_it_started(tmp_path):
    """A new user's script: the save of its last due step was abandoned as the
    interpreter ended ("abandoned: the process ended while it was under way"), and a
    run that saved steps 5 and 10 left no checkpoint at all."""
    url = str(tmp_path / "ck")
    run = _run(tmp_path, "end", url)
    assert run.returncode == 0, run.stderr
    assert "its save of step 5 finishes first. Call close()" in run.stderr, run.stderr
    assert "abandoned" not in run.stderr, run.stderr
    assert ub.open_store(url).exists("step-000000000005/manifest.json"), run.stderr
    attempt = _goodput(url)["attempts"][0]
    assert attempt["clean"] and not attempt["preempted"]  # the script ended: a clean end


def test_a_script_that_dies_of_an_exception_keeps_its_save_and_is_counted_a_crash(tmp_path):
    url = str(tmp_path / "ck")
    run = _run(tmp_path, "raise", url)
    assert run.returncode == 1 and "a bug after the save of step 5" in run.stderr
    assert ub.open_store(url).exists("step-000000000005/manifest.json"), run.stderr
    again = _run(tmp_path, "raise", url)  # restarted: it goes on from step 5
    assert "a bug after the save of step 10" in again.stderr, again.stderr
    report = _goodput(url)
    assert report["restarts"] == 1 and report["runs"] == 1, report
    assert not report["attempts"][0]["clean"]


def test_a_with_block_ended_by_an_exception_is_a_crash_and_its_rerun_a_restart(tmp_path):
    """The rerun of a job whose ``with`` block an exception ended (a NaN check, a peer's
    crash failing a collective) was counted as a new run: the END written on the way
    out said the job was done, so its down time and restart went uncounted."""
    url = str(tmp_path / "ck")
    assert "NaN loss at step 8" in _run(tmp_path, "with", url).stderr
    assert _run(tmp_path, "with", url).returncode == 0
    report = _goodput(url)
    assert report["restarts"] == 1 and report["runs"] == 1, report
    assert report["wasted_steps"] == 2  # steps 6 and 7 ran again


_DIST_JOB = """
import sys, time, torch, torch.distributed as dist, unbroken as ub
dist.init_process_group("gloo")
url, staging, destroy = sys.argv[1], sys.argv[2], sys.argv[3] == "destroy"
model = torch.nn.Linear(1024, 1024)
mgr = ub.CheckpointManager(url, staging_dir=f"{staging}-{dist.get_rank()}", every_steps=5)
for step in range(1, 6):
    time.sleep(0.05)
    mgr.maybe_save(step, {"model": model})
if destroy:
    dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_two_ranks_that_never_call_close_commit_their_last_save_together(tmp_path):
    """Every rank closes at its end, so the commit's collectives meet; a process group
    destroyed before that leaves the save lost, and says so and how to keep it."""
    script = tmp_path / "job.py"
    script.write_text(_DIST_JOB)
    for how in ("keep", "destroy"):
        url = str(tmp_path / f"ck-{how}")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", "0", str(script), url, str(tmp_path / f"st-{how}"), how,
        ]  # fmt: skip
        run = subprocess.run(
            cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out
        committed = ub.open_store(url).exists("step-000000000005/manifest.json")
        if how == "keep":
            assert committed and out.count("its save of step 5 finishes first") == 2, out
        else:
            assert not committed
            assert out.count("call mgr.close() before dist.destroy_process_group()") == 2, out
