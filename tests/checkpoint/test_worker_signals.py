"""DataLoader workers and the signals schedulers send (unbroken._util.worker_sigterm).

Real processes: a training process with worker processes (ub.DataLoader, or torch's own
with a CheckpointManager in the process), signalled from outside as torchrun and Slurm do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from .distributed import ROOT, toy_volume

SCRIPT = Path(__file__).with_name("_loader_children.py")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))


def _run(*args: str, timeout: float = 120) -> str:
    """``python *args`` as a user's process, which must end well: its stdout's lines."""
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


pytestmark = pytest.mark.multiprocess


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(toy_volume(tmp_path, 32, 4)), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(),
    )  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("WORKERS"), line + proc.stderr.read()
    return proc, [int(p) for p in line.split()[1:]]


def _more_batches(proc: subprocess.Popen) -> str:
    proc.stdin.write("next\n")
    proc.stdin.flush()
    return proc.stdout.readline()


@pytest.mark.parametrize("mode", ["ub", "torch"])
def test_workers_outlive_a_sigterm_from_outside_and_end_with_their_parent(tmp_path, mode):
    """torchrun's killpg and Slurm's signal reach the workers too: they used to die, and
    torch's SIGCHLD handler raised in the training process before it could save. (Fork
    only: spawned workers are not covered yet, see docs/checkpoints.md.)"""
    proc, workers = _start(tmp_path, mode)
    try:
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert _more_batches(proc).strip() == "OK", proc.stderr.read()
        assert all(psutil.pid_exists(pid) for pid in workers)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        gone = psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)],
                                 timeout=30)[1]  # fmt: skip
        assert not gone, "workers outlived their parent"
    finally:
        proc.kill()


def test_without_a_manager_torchs_workers_keep_torchs_behaviour(tmp_path):
    """Only a process with a preemption watch changes torch's own workers."""
    proc, workers = _start(tmp_path, "torch-alone")
    try:
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert psutil.wait_procs([psutil.Process(p) for p in workers], timeout=30)[1] == []
        assert "OK" not in _more_batches(proc)
    finally:
        proc.kill()
        proc.wait()


_REAPER = """
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
proc = subprocess.Popen([sys.executable, *sys.argv[1:]], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
workers = [int(p) for p in proc.stdout.readline().split()[1:]]
os.kill(proc.pid, signal.SIGKILL)
ends = {}
while len(ends) < len(workers) + 1:
    pid, status = os.waitpid(-1, 0)
    ends[pid] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
print(*(ends.get(w) for w in workers))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_killed_ranks_workers_die_with_it(tmp_path):
    """Issue 29.3: a SIGKILLed rank's workers, orphaned, kept its gloo sockets open for
    up to 5 s (until torch's watchdog ended them): its peers' collectives blocked instead
    of failing, and every crash cost that much more. They now die with their parent."""
    out = _run("-c", _REAPER, str(SCRIPT), str(toy_volume(tmp_path, 32, 4)), "ub")
    assert out.split() == [str(int(signal.SIGKILL))] * 2, out


_FORKS = """
import logging, multiprocessing as mp, os, signal, sys, tempfile, time
import torch
import unbroken as ub
from unbroken.checkpoint import preemption

logging.basicConfig(level=logging.INFO)
preemption.HANDLE_WITHIN_SECONDS = 3600.0  # a child that took the watch's handler waits so
case = sys.argv[1]
if case == "users-handler":
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(7))
root = tempfile.mkdtemp()
mgr = ub.CheckpointManager(f"{root}/ck", staging_dir=f"{root}/st")
if case == "at-start":  # a SIGTERM in the moment each forked child starts
    os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))
    data = [torch.full((4,), float(i)) for i in range(16)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2)
    print("BATCHES", sum(1 for _ in loader), flush=True)
proc = mp.get_context("fork").Process(target=time.sleep, args=(600,))
proc.start()
if case != "at-start":
    time.sleep(0.5)
    proc.terminate()
proc.join(60)
print("CHILD", proc.exitcode, flush=True)
mgr.close()
"""


@pytest.mark.parametrize("case", ["default", "users-handler", "at-start"])
def test_a_forked_child_takes_sigterm_as_it_would_without_a_manager(case):
    """A Process or Pool worker forked while a manager is open inherited its handler: its
    terminate() waited 10 s for a maybe_save the child never makes, and logged "SIGTERM
    received". A DataLoader worker signalled before its own handling is set up defers
    the signal (it did not die, but logged so, and passed it on 10 s later)."""
    out = subprocess.run(
        [sys.executable, "-c", _FORKS, case], capture_output=True, text=True, timeout=120,
        env=_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    expected = {"default": -signal.SIGTERM, "users-handler": 7, "at-start": -signal.SIGTERM}
    lines = out.stdout.split("\n")
    assert f"CHILD {int(expected[case])}" in lines, out
    if case == "at-start":
        assert "BATCHES 8" in lines, out
    assert "SIGTERM received" not in out.stderr, out.stderr


_FORK_SHAPES = """
import multiprocessing as mp, os, signal, subprocess, sys, tempfile, threading, time
import torch
import unbroken as ub

BIT = 1 << (signal.SIGTERM - 1)


def blocked():
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return any(l.startswith("SigBlk") and int(l.split()[1], 16) & BIT for l in f)


def report(q):
    q.put(blocked())


def grandchild(q):  # a Pool worker's own subprocess, with a preexec_fn (Python's fork hooks)
    p = subprocess.Popen(["sleep", "30"], preexec_fn=os.setpgrp)
    time.sleep(0.2)
    p.terminate()
    try:
        q.put(p.wait(timeout=10))
    except subprocess.TimeoutExpired:
        p.kill()
        q.put("ignored terminate()")


def train(root):  # a child that trains with a manager of its own, preempted at step 5
    with ub.CheckpointManager(f"{root}/child", staging_dir=f"{root}/cst", every_steps=1000) as m:
        for step in range(1, 60):
            time.sleep(0.05)
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            m.maybe_save(step, {"w": torch.zeros(3)})


root = tempfile.mkdtemp()
mgr = ub.CheckpointManager(f"{root}/parent", staging_dir=f"{root}/pst")
ctx = mp.get_context("fork")
bad = []


def forks(n):  # two threads fork at once: each restores its own mask
    for _ in range(n):
        q = ctx.SimpleQueue()
        p = ctx.Process(target=report, args=(q,))
        p.start()
        bad.extend([1] if q.get() else [])
        p.join()


sys.setswitchinterval(1e-6)
t = threading.Thread(target=forks, args=(40,))
t.start()
forks(40)
t.join()
sys.setswitchinterval(0.005)
print("RACE", len(bad), blocked(), flush=True)
q = ctx.SimpleQueue()
p = ctx.Process(target=grandchild, args=(q,))
p.start()
print("GRANDCHILD", q.get(), flush=True)
p.join()
p = ctx.Process(target=train, args=(root,))
p.start()
p.join(120)
print("TRAINER", p.exitcode, sorted(os.listdir(f"{root}/child")), flush=True)
mgr.close()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads SigBlk in /proc")
def test_forks_under_an_open_manager_leave_no_sigterm_blocked_and_a_childs_manager_saves():
    """multiprocessing forks block SIGTERM until the child knows it is no DataLoader
    worker. Review: two threads forking at once left it blocked in children and in the
    main thread (one mask for two threads); a Pool worker's own subprocess kept it blocked
    (it ignored terminate()); a child training with a manager of its own died of the
    signal instead of saving (the inherited handler ended it)."""
    lines = _run("-c", _FORK_SHAPES, timeout=300).split("\n")
    assert "RACE 0 False" in lines, lines
    assert f"GRANDCHILD {-signal.SIGTERM}" in lines, lines
    assert any(line.startswith("TRAINER 143 ") and "step-000000000005" in line for line in lines), (
        lines
    )


_TWO_THREADS_FORK = """
import ctypes, os, sys, tempfile, threading, time
import torch, torch.utils.data
import unbroken._util.spawn, unbroken.storage.fork_relay  # at-fork hooks that take locks

builder_in_fork, main_forked = threading.Event(), threading.Event()


def hold_the_builders_fork():  # runs after unbroken's before-fork hook (registered first)
    if threading.current_thread().name == "builder":
        builder_in_fork.set()
        main_forked.wait(10)  # the main thread forks meanwhile


os.register_at_fork(before=hold_the_builders_fork)
import unbroken as ub


class PdeathSig(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        sig = ctypes.c_int()
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
        return sig.value


root = tempfile.mkdtemp()
mgr = ub.CheckpointManager(f"{root}/ck", staging_dir=f"{root}/st", memory_tier=False)
box = {}


def build():
    box["it"] = iter(torch.utils.data.DataLoader(PdeathSig(), batch_size=1, num_workers=1))
    box["first"] = int(next(box["it"]))


builder = threading.Thread(target=build, name="builder")
builder.start()
assert builder_in_fork.wait(30)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
main_forked.set()
builder.join()  # the thread that forked the worker ends
time.sleep(0.5)
print("PDEATHSIG", box["first"], flush=True)
print("BATCHES", sum(1 for _ in range(5) if next(box["it"]) is not None), flush=True)
mgr.close()
"""


def test_a_worker_forked_from_another_thread_outlives_that_thread_whoever_forks_beside_it():
    """The parent-death signal follows the thread that forked. The flag saying whether a
    fork came from the main thread was one for the process: the main thread forking at
    the same moment made a worker forked by a short-lived thread take the signal, and
    the worker was killed when that thread ended ("DataLoader worker exited unexpectedly")."""
    lines = _run("-c", _TWO_THREADS_FORK).split("\n")
    assert "PDEATHSIG 0" in lines and "BATCHES 5" in lines, lines
