"""Run by test_world.py under real torchrun, or as srun starts tasks: a script that
never calls init_process_group. Prints what the manager and the dataset said."""

import os
import sys

import unbroken as ub


def say(line: str) -> None:
    # One write per line: two ranks share torchrun's stdout, and a print's text and its
    # newline can reach the pipe apart, joining the ranks' lines.
    os.write(1, (line + "\n").encode())


volume = sys.argv[1]
rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
for name, make in [
    ("manager", lambda: ub.CheckpointManager(sys.argv[2], staging_dir=sys.argv[3])),
    ("dataset", lambda: ub.VolumeDataset(volume)),
]:
    try:
        make()
        say(f"{name} {rank} ACCEPTED")
    except RuntimeError as exc:
        say(f"{name} {rank} REFUSED {exc}")
