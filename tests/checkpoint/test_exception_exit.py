"""A rank that dies of an exception exits with its own code, with saves in flight."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .distributed import ROOT, free_port, rank_env

_JOB = """
import sys, torch, torch.distributed as dist, unbroken as ub
dist.init_process_group("gloo")
model = torch.nn.Linear(256, 256)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optim": optim}
mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], every_steps=2)
for step in range(1, 40):
    model(torch.randn(8, 256)).sum().backward()
    optim.step()
    optim.zero_grad()
    mgr.maybe_save(step, state)  # the save's background half runs on
    if step == int(sys.argv[3]) and dist.get_rank() == 1:
        raise RuntimeError("a bug in the loop of rank 1")
mgr.close()
"""


@pytest.mark.multiprocess
def test_a_rank_that_raises_with_a_save_in_flight_exits_1_not_sigabrt(tmp_path):
    """A hostile user's find: the raising rank aborted (SIGABRT, "terminate called
    without an active exception", a core file) in 5 of 6 runs, and torchrun reported a
    crash instead of the exception: the interpreter's end killed the checkpoint thread
    inside torch's C++ code (``_util/rest_at_exit.py``)."""
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    for raise_at in (5, 6, 7):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", "0", str(script),
            str(tmp_path / f"ck{raise_at}"), str(tmp_path / f"st{raise_at}"), str(raise_at),
        ]  # fmt: skip
        run = subprocess.run(
            cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=180
        )
        out = run.stdout + run.stderr
        assert run.returncode != 0 and "a bug in the loop of rank 1" in out, out
        assert "terminate called" not in out and "SIGABRT" not in out, out
        assert "exitcode  : 1 " in out, out  # torchrun's report of the raising rank
