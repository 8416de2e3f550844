"""``unbroken goodput URL``: where the job's wall time went, from its event log."""

from __future__ import annotations

import argparse
import json
import time

from unbroken.cli import text
from unbroken.cli.errors import CliError
from unbroken.cli.stores import add_storage_arguments, open_existing, storage_options
from unbroken.goodput.breakdown import CATEGORIES, Breakdown, job_breakdown
from unbroken.goodput.events import PREFIX, read_log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "goodput",
        help="the job's goodput and where the rest of its time went",
        description="Read the event log the job's CheckpointManager and DataLoader wrote "
        f"beside its checkpoints ({PREFIX}/ under URL) and break the wall time, from the "
        "first process start to the last event, into productive, data_wait, "
        "checkpoint_save, checkpoint_restore, startup, wasted, down and other.",
    )
    p.add_argument("url", help="the checkpoint root")
    p.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    p.add_argument("--rank", type=int, default=0, help="whose timeline (default 0: the job's)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the timeline (matplotlib)")
    add_storage_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.rank < 0:
        raise CliError(f"--rank must be >= 0, got {args.rank}", code=2)
    store = open_existing(args.url, storage_options(args))
    log = read_log(store)
    if not log:
        raise CliError(
            f"no goodput events under {store.url_for(PREFIX)}: was the job run with goodput "
            "recording off (goodput=False, UNBROKEN_GOODPUT=0) or by an older unbroken?"
        )
    b = job_breakdown(log, args.rank)
    if not b.attempts:
        ranks = sorted({r for by_rank in log.values() for r in by_rank})
        raise CliError(f"no events of rank {args.rank} (ranks with events: {ranks})")
    if args.plot:
        from unbroken.cli.plot import plot_timeline

        plot_timeline(b, args.plot)
    if args.json:
        print(json.dumps(b.as_dict(), indent=1))
    else:
        print(render(b))
        if args.plot:
            print(f"\ntimeline: {args.plot}")
    return 0


def render(b: Breakdown) -> str:
    restarts = f"{b.restarts} restart" + ("" if b.restarts == 1 else "s")
    head = (
        f"goodput {b.goodput:.1%} of {text.duration(b.wall_seconds)} wall (rank {b.rank}), "
        f"{restarts}, {b.steps} steps ({b.wasted_steps} redone)"
    )
    wall = b.wall_seconds or 1.0
    rows = [[c, f"{b.seconds[c]:.1f}", f"{b.seconds[c] / wall:.1%}"] for c in CATEGORIES]
    cats = text.table(["category", "seconds", "share"], rows, right=(1, 2))
    att_rows = [
        [
            a.attempt,
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(a.start)),
            text.duration(a.end - a.start),
            f"{a.goodput:.1%}",
            f"{a.first_step}-{a.last_step}" if a.steps else "-",
            str(a.wasted_steps),
            "-" if a.restored_step is None else str(a.restored_step),
            "clean" if a.clean else "crashed",
        ]
        for a in b.attempts
    ]
    atts = text.table(
        ["attempt", "started (UTC)", "ran", "goodput", "steps", "redone", "restored", "ended"],
        att_rows,
    )
    return f"{head}\n\n{cats}\n\n{atts}"
