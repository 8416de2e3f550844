"""Run by test_world.py under real torchrun: a script that never calls
init_process_group. Prints what the manager and the dataset said."""

import os
import sys

import unbroken as ub

volume = sys.argv[1]
for name, make in [
    ("manager", lambda: ub.CheckpointManager(sys.argv[2], staging_dir=sys.argv[3])),
    ("dataset", lambda: ub.VolumeDataset(volume)),
]:
    try:
        make()
        print(f"{name} {os.environ['RANK']} ACCEPTED", flush=True)
    except RuntimeError as exc:
        print(f"{name} {os.environ['RANK']} REFUSED {exc}", flush=True)
