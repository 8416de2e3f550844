"""A job whose saves upload from the save helper: ``python save_helper_job.py URL STAGING``.

It commits step 2, prints ``committed``, then waits to be killed: the test then checks
that its helper does not outlive it.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import unbroken as ub
from tests.checkpoint.manager_util import make_state


def main(url: str, staging: str) -> None:
    state = make_state(0)
    mgr = ub.CheckpointManager(
        url, staging_dir=staging, every_steps=2, storage_options={"latency": 0.0}
    )
    mgr.save(2, state)
    mgr.wait()
    print("committed", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:3])
