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
if how == "thread":  # the main thread returns; the loop goes on on its own thread
    import threading
    made = threading.Event()
    def loop():
        mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=5)
        made.set()
        for step in range(1, 11):
            time.sleep(0.1)
            mgr.maybe_save(step, state)
    threading.Thread(target=loop).start()
    made.wait()
    sys.exit(0)
mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=5)
start = mgr.restore(state) or 0
if how == "end":  # a child that ends as a script does leaves the parent's log alone
    import os
    local = mgr._goodput.log.local_path
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(local), "the child removed the parent's event log"
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
    run that saved steps 5 and 10 left no checkpoint at all. A child it forks and that
    ends as a script does removed the parent's local event log (it asserts it did not)."""
    url = str(tmp_path / "ck")
    run = _run(tmp_path, "end", url)
    assert run.returncode == 0, run.stderr
    assert "its save of step 5 finishes first. Call close()" in run.stderr, run.stderr
    assert "abandoned" not in run.stderr, run.stderr
    assert ub.open_store(url).exists("step-000000000005/manifest.json"), run.stderr
    attempt = _goodput(url)["attempts"][0]
    assert attempt["clean"] and not attempt["preempted"]  # the script ended: a clean end


def test_a_loop_on_a_thread_the_main_thread_left_running_is_not_closed_under_it(tmp_path):
    """The exit hook runs before the interpreter waits for such a thread: it closed the
    manager under the loop, which failed at its next save with 'closed'."""
    url = str(tmp_path / "ck")
    run = _run(tmp_path, "thread", url)
    assert run.returncode == 0 and "closed" not in run.stderr, run.stderr
    assert ub.open_store(url).exists("step-000000000010/manifest.json"), run.stderr


def test_an_interactive_session_with_a_failed_line_ends_as_finished(tmp_path):
    """A REPL (or Jupyter) keeps the last traceback of any line: a session whose early
    typo was long fixed was counted as a crash at its end."""
    url = str(tmp_path / "ck")
    lines = [
        "import torch, unbroken as ub",
        "undefined_name",  # a typo, said and forgotten
        f"mgr = ub.CheckpointManager({url!r}, staging_dir={str(tmp_path / 'st')!r})",
        "mgr.save(1, {'model': torch.nn.Linear(4, 2)})",
    ]
    run = subprocess.run(
        [sys.executable, "-i"], input="\n".join(lines) + "\n", cwd=ROOT, env=rank_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "NameError" in run.stderr
    assert ub.open_store(url).exists("step-000000000001/manifest.json"), run.stderr
    assert _goodput(url)["attempts"][0]["clean"], run.stderr


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


_SIGTERM_AT_THE_END = """
import os, signal, sys, threading, time, torch, unbroken as ub
import unbroken.checkpoint.preemption as preemption
preemption.HANDLE_WITHIN_SECONDS = 1.0
d = sys.argv[1]
state = {"w": torch.zeros(1_000_000)}  # 4 MB: 4 s of upload at 1 MB/s
mgr = ub.CheckpointManager(f"emulated::{d}/ck", staging_dir=f"{d}/st", every_steps=5,
                           storage_options={"bandwidth": 1e6, "latency": 0})
for step in range(1, 6):
    mgr.maybe_save(step, state)
def signal_in(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=signal_in, args=(0.5,), daemon=True).start()
"""


def test_a_sigterm_while_the_end_waits_for_the_last_save_lets_it_land(tmp_path):
    """The wait at the interpreter's end counted as the loop's time: a SIGTERM then was
    passed on after 10 s ('no maybe_save acted on it'), and the save was lost."""
    run = subprocess.run(
        [sys.executable, "-c", _SIGTERM_AT_THE_END, str(tmp_path)],
        cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode in (-15, 143), run.stderr  # the signal goes on once it landed
    store = ub.open_store(str(tmp_path / "ck"))
    assert store.exists("step-000000000005/manifest.json"), run.stderr
