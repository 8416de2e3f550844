"""unbroken demo: the main job, trained through crashes, measured by goodput.

1. Writes a small image dataset of raw files to a local directory that stands in for
   the remote volume (read through the emulated standard remote: 20 ms per request,
   200 MB/s), unless --data names one.
2. Trains the job (unbroken.demo.job) on 2 ranks under torchrun, once without
   failures: the reference.
3. Trains it again under torchrun --max-restarts, killing a random rank with
   SIGKILL at random moments (mid-step, mid-save, mid-upload: wherever it lands).
   torchrun restarts the ranks; the job resumes by itself from the newest committed
   checkpoint.
4. Prints where the time went (the goodput breakdown from the job's own event log),
   draws its timeline, gives the checkpoint and data-pipeline figures, and says whether
   the crashed run ended bitwise equal to the reference: same samples, same order, same
   augmentations, same dropout masks, same weights and optimizer state.
5. Keeps its directory (the volume, both runs' checkpoints, goodput logs and job logs) and
   prints the commands that inspect it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from unbroken._util.procs import children, kill_tree
from unbroken.cli.argtypes import int_at_least, seconds

RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
"""Every launch carries torchrun's restart workaround (see docs/launch.md)."""


def write_dataset(root: str, files: int) -> None:
    """``files`` raw 3x16x16 uint8 images with a learnable label in each file's name."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    for i in range(files):
        label = int(rng.integers(10))
        image = rng.integers(0, 256, size=(3, 16, 16), dtype=np.uint8)
        image[label % 3] //= 2
        with open(os.path.join(root, f"{label}-{i:05d}.raw"), "wb") as f:
            f.write(image.tobytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Kill:
    """One SIGKILL the driver sent, and what the job had committed by then."""

    t: float
    """Wall time (Unix seconds, the goodput timeline's clock)."""
    attempt: int
    """1 for the first attempt (torchrun's restart count + 1), as the timeline numbers it."""
    step: int
    """The step rank 0 had reached."""
    committed: int | None
    """The newest committed checkpoint at that moment: what the restart resumes from."""


@dataclass
class Run:
    """One torchrun job of the demo and what it reported."""

    name: str
    checkpoints: str
    result: dict = field(default_factory=dict)
    wall: float = 0.0
    kills: list[Kill] = field(default_factory=list)


def launch(args: argparse.Namespace, run: Run, tmp: str, restarts: int) -> subprocess.Popen:
    progress = os.path.join(tmp, f"{run.name}.progress")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", "2", "--max-restarts", str(restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--monitor-interval", "0.5",
        "-m", "unbroken.demo.job",
        "--data", args.data, "--checkpoints", run.checkpoints,
        "--staging-dir", os.path.join(tmp, f"{run.name}-staging"),
        "--steps", str(args.steps), "--every-steps", str(args.every_steps),
        "--step-seconds", str(args.step_seconds),
        "--progress", progress, "--result", os.path.join(tmp, f"{run.name}.json"),
    ]  # fmt: skip
    log = open(os.path.join(tmp, f"{run.name}.log"), "w")  # noqa: SIM115 (closed by the child)
    # Each run has a node cache of its own, so the crashed run does not read the cache the
    # reference filled (its restarts do share theirs, as a node's would).
    cache = os.path.join(tmp, f"{run.name}-cache")
    env = {**os.environ, **RESTART_ENV, "UNBROKEN_CACHE_DIR": cache}
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def read_progress(path: str) -> tuple[int, int, str]:
    """(attempt, step, where its restore came from) rank 0 reported last, (0, 0, "")
    before it did; attempts count from 1 (torchrun's restart count + 1), as the
    timeline's lanes do."""
    try:
        with open(path) as f:
            restarts, step, *restored = f.read().split()
        came = f"from the {restored[0]} tier in {float(restored[1]):.2f} s" if restored else ""
        return int(restarts) + 1, int(step), came
    except (OSError, ValueError, IndexError):
        return 0, 0, ""


def newest_committed(url: str) -> int | None:
    """The newest committed step of ``url`` now, or None."""
    import unbroken as ub
    from unbroken.checkpoint.catalog import newest_committed as newest

    info = newest(ub.open_store(url))
    return None if info is None else info.step


def why_lost(kill: Kill, every_steps: int) -> str:
    """What a kill cost, in words: the steps since the newest commit, and why that commit
    is older than the last due save (a save commits seconds after its step)."""
    due = kill.step // every_steps * every_steps
    base = kill.committed or 0
    if kill.committed is None:
        said = "no checkpoint had committed yet, so the job starts over"
    else:
        said = f"it resumes from step {kill.committed}, the newest committed checkpoint"
    if due > base:
        said += f" (the save of step {due} was still on its way to the durable tier)"
    return said


def supervise(args: argparse.Namespace, run: Run, tmp: str, kills: int, pace: float) -> None:
    """Run the job to its end with a progress bar, SIGKILLing a random rank ``kills``
    times. Each kill comes once the attempt has trained a save interval past where it
    resumed (so it has something to lose), after a random further delay of up to
    1.5 intervals at ``pace`` seconds per step (mid-step, mid-save or mid-upload), and
    at the latest a step before the last interval, where no kill comes."""
    from tqdm import tqdm

    proc = launch(args, run, tmp, restarts=kills)
    progress = os.path.join(tmp, f"{run.name}.progress")
    start = time.monotonic()
    interactive = sys.stdout.isatty() and not args.quiet
    bar = tqdm(total=args.steps, desc=f"{run.name:>9}", unit="step", dynamic_ncols=True,
               file=sys.stdout, disable=not interactive, mininterval=0.2)  # fmt: skip
    last_attempt, resumed, kill_at = 0, 0, None

    def say(line: str) -> None:
        if interactive:
            bar.write(line)
        elif not args.quiet:
            print(line, flush=True)

    try:
        while proc.poll() is None:
            time.sleep(0.05)
            attempt, step, came = read_progress(progress)
            if attempt != last_attempt:  # a restart: the bar goes back to the restored step
                if last_attempt:
                    say(f"  {run.name}: attempt {attempt} resumed by itself at step {step - 1}"
                        + (f", {came}" if came else ""))  # fmt: skip
                last_attempt, resumed = attempt, step - 1
                bar.set_postfix_str(f"attempt {attempt}")
            if step != bar.n:
                bar.n = step
                bar.refresh()
            end_zone = step >= args.steps - args.every_steps
            if (
                len(run.kills) < kills
                and kill_at is None
                and not end_zone
                and (step >= resumed + args.every_steps)
            ):
                kill_at = time.monotonic() + random.uniform(0, 1.5 * args.every_steps * pace)
            # the attempt ran faster than the pace: the kill lands before the end zone
            last_chance = step >= args.steps - args.every_steps - 1
            if kill_at is not None and (time.monotonic() >= kill_at or last_chance):
                kill_at = None
                ranks = children(proc.pid)
                if ranks and not end_zone:
                    victim = random.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    kill = Kill(time.time(), attempt, step, newest_committed(run.checkpoints))
                    run.kills.append(kill)
                    lost = why_lost(kill, args.every_steps)
                    say(f"  {run.name}: killed a rank of attempt {attempt} (SIGKILL, pid "
                        f"{victim}) at step {step}: {lost}")  # fmt: skip
                    resumed = args.steps  # no further kill until the next attempt reports
    except BaseException:  # Ctrl-C, or the demo's own failure: the ranks and helpers too
        kill_tree(proc.pid)
        proc.wait()
        raise
    finally:
        bar.close()
    run.wall = time.monotonic() - start
    if proc.returncode != 0:
        with open(os.path.join(tmp, f"{run.name}.log")) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"demo FAILED: the {run.name} job exited {proc.returncode} (its log: "
                         f"{tmp}/{run.name}.log):\n{tail}")  # fmt: skip
    with open(os.path.join(tmp, f"{run.name}.json")) as f:
        run.result = json.load(f)
    say(f"  {run.name}: {args.steps} steps in {run.wall:.0f} s")


def report(args: argparse.Namespace, reference: Run, crashed: Run) -> bool:
    """Print the figures; True if the crashed run ended bitwise equal to the reference."""
    import unbroken as ub
    from unbroken.cli.errors import CliError
    from unbroken.cli.goodput import render
    from unbroken.cli.plot import lane_of
    from unbroken.goodput.breakdown import job_breakdown
    from unbroken.goodput.events import read_log

    b = job_breakdown(read_log(ub.open_store(crashed.checkpoints)))
    ref_b = job_breakdown(read_log(ub.open_store(reference.checkpoints)))
    print("\n== where the time of the crashed run went (`unbroken goodput` on its checkpoints)")
    print(render(b))
    print(f"\nthe same job without failures (the reference run): goodput {ref_b.goodput:.1%} "
          f"of {ref_b.wall_seconds:.0f} s")  # fmt: skip
    if args.plot:
        try:
            from unbroken.cli.plot import plot_timeline

            kills = [k.t for k in crashed.kills]
            written = plot_timeline(b, args.plot, kills=kills, reference=ref_b.goodput)
            print(f"\ntimeline of the crashed run: {written} (x: each kill)")
        except CliError as exc:  # matplotlib is missing: the rest of the report stands
            print(f"\n(no timeline: {exc})")

    r = crashed.result
    print("\n== checkpoints (last attempt, rank 0)")
    print(f"  saves committed: {r['saves_committed']}, skipped while one was in flight: "
          f"{r['saves_skipped_busy']}")  # fmt: skip
    print(f"  training loop blocked per save: {r['seconds_blocked_per_save'] * 1e3:.1f} ms")
    if r["last_commit_seconds"] is not None:
        print(f"  save to commit: {r['last_commit_seconds']:.2f} s in the background")
    if r["restore"]:
        print(f"  restore: step {r['restore']['step']} from the {r['restore']['tier']} tier "
              f"in {r['restore']['seconds']:.2f} s")  # fmt: skip
    print("\n== data pipeline (last attempt, rank 0)")
    lookups = r["cache_hits"] + r["cache_misses"]
    ratio = r["cache_hits"] / lookups if lookups else 0.0
    print(
        f"  waited for data: {r['fetch_seconds']:.2f} s over {r['batches']} batches "
        f"({r['fetch_seconds'] / max(r['batches'], 1) * 1e3:.1f} ms per batch)"
    )
    print(f"  local cache: {ratio:.0%} hits, {r['bytes_fetched'] / 1e6:.1f} MB fetched "
          "from the remote")  # fmt: skip

    ref = reference.result
    same_losses = all(
        crashed.result["losses"][s] == ref["losses"][s] for s in crashed.result["losses"]
    )
    equal = (ref["weights"], ref["optimizer"]) == (r["weights"], r["optimizer"]) and same_losses
    print("\n== the result")
    print(f"  reference run: {ref['steps']} steps in {reference.wall:.0f} s, no failure")
    print(f"  crashed run:   {r['steps']} steps in {crashed.wall:.0f} s, "
          f"{len(crashed.kills)} kills of a random rank of 2, {b.restarts} restarts")  # fmt: skip
    t0 = b.attempts[0].start if b.attempts else 0.0
    for k in crashed.kills:
        print(f"    attempt {lane_of(b, k.t) + 1} killed at {k.t - t0:.1f} s (the timeline's "
              f"axis), step {k.step}: {why_lost(k, args.every_steps)}")  # fmt: skip
    print(
        f"  final model and optimizer bitwise equal to the reference: "
        f"{'yes' if equal else 'NO'} (weights {r['weights']}, reference {ref['weights']})"
    )
    return equal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="a volume of raw images to read (default: one is made)")
    p.add_argument("--checkpoints", help="where the crashed run checkpoints (default: "
                   "checkpoints/ in the demo's directory, kept after it ends)")  # fmt: skip
    p.add_argument(
        "--steps", type=int_at_least(1), default=80, help="training steps (default: %(default)s)"
    )
    p.add_argument(
        "--every-steps",
        type=int_at_least(1),
        default=10,
        help="save every N steps (default: %(default)s)",
    )
    p.add_argument(
        "--kills",
        type=int_at_least(0),
        default=3,
        help="times a random rank is SIGKILLed (default: %(default)s)",
    )
    p.add_argument(
        "--files",
        type=int_at_least(32, " (2 ranks, a batch of 16 each)"),
        default=1024,
        help="images in the made volume (default: %(default)s)",
    )
    p.add_argument(
        "--step-seconds",
        type=seconds,
        default=0.05,
        help="extra seconds per step, standing in for a larger model (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="of the kill moments (default: a random one, printed)",
    )
    p.add_argument(
        "--plot",
        default="unbroken-demo-timeline.png",
        help="the timeline picture, empty for none (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    # a SIGTERM ends the demo as Ctrl-C does: its jobs' processes with it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seed = args.seed if args.seed is not None else random.randrange(1 << 16)
    random.seed(seed)
    print("unbroken demo: a small CNN trained on 2 ranks twice, once without failures and "
          f"once with a random rank SIGKILLed {args.kills} times; then where the time went "
          "and whether the two runs ended bitwise equal")  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="unbroken-demo-")  # kept: its checkpoints are to look at
    if args.data is None:
        write_dataset(os.path.join(tmp, "volume"), args.files)
        args.data = f"emulated::{tmp}/volume"
        print(f"made a volume of {args.files} images at {tmp}/volume, read through the "
              "emulated remote (20 ms per request, 200 MB/s)")  # fmt: skip
    crashed_url = args.checkpoints or f"emulated::{tmp}/checkpoints"
    print(f"training {args.steps} steps on 2 ranks (gloo), saving every "
          f"{args.every_steps}; kill moments from seed {seed}")  # fmt: skip
    reference = Run("reference", f"emulated::{tmp}/reference-checkpoints")
    supervise(args, reference, tmp, 0, 0.0)
    pace = reference.result["train_seconds"] / args.steps
    crashed = Run("crashed", crashed_url)
    supervise(args, crashed, tmp, args.kills, pace)
    equal = report(args, reference, crashed)
    print(f"\n== kept in {tmp} (logs, both runs' checkpoints and goodput logs)")
    where = crashed.checkpoints.removeprefix("emulated::")
    for verb in ("ls", "verify", "goodput"):
        print(f"  unbroken {verb} {where}")
    print(f"  rm -rf {tmp}   # when done")
    if not equal:
        print("demo FAILED: the crashed run diverged from the reference", file=sys.stderr)
        return 1
    if len(crashed.kills) < args.kills:
        print(f"only {len(crashed.kills)} of the {args.kills} kills landed: the run ended "
              "first (more --steps leave room for them)")  # fmt: skip
    print("demo OK: every crash cost only the steps since the last commit and the restart")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
