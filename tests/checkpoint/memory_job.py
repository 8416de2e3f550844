"""A job for the memory tier's tests: train, commit step 4, then end as told.

``python memory_job.py URL STAGING OUT {kill,sigterm,close}``: ``kill`` SIGKILLs itself
once step 4 is committed, ``sigterm`` trains on until a SIGTERM's save ends it (exit 143),
``close`` ends cleanly. The state lives on ``$UNBROKEN_TEST_DEVICE`` (default cpu). OUT
gets what step 4 held (``expected.pt``) and the RNG draws that follow it
(``draws.json``), for a restarted process to compare with.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import unbroken as ub
from tests.checkpoint.manager_util import make_state, rng_draws, snapshot, train


def main(url: str, staging: str, out: str, end: str) -> None:
    device = os.environ.get("UNBROKEN_TEST_DEVICE", "cpu")
    state = make_state(0, device=device)
    mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=2, when_busy="wait")
    mgr.restore(state)
    for step in range(1, 5):
        train(state, range(step, step + 1))
        mgr.maybe_save(step, state)
    mgr.wait()
    expected = {k: v for k, v in snapshot(state).items() if isinstance(v, torch.Tensor)}
    torch.save(expected, os.path.join(out, "expected.pt"))
    with open(os.path.join(out, "draws.json"), "w") as f:
        json.dump(rng_draws(cuda=device == "cuda"), f)
    print(f"committed 4 tier={mgr.memory_tier.path if mgr.memory_tier else None}", flush=True)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "sigterm":
        step = 4
        while True:  # a preemption saves the step reached and exits 143
            step += 1
            time.sleep(0.02)
            mgr.maybe_save(step, state)
    mgr.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
