"""``unbroken goodput URL``: where the job's wall time went, from its event log."""

from __future__ import annotations

import argparse
import json
import sys
import time

from unbroken.cli import text
from unbroken.cli.errors import CliError
from unbroken.cli.stores import add_storage_arguments, open_existing, storage_options
from unbroken.goodput import jobs
from unbroken.goodput.breakdown import CATEGORIES, AttemptSummary, Breakdown, job_breakdown
from unbroken.goodput.events import PREFIX, read_log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "goodput",
        help="the job's goodput and where the rest of its time went",
        description="Read the event log the job's CheckpointManager and DataLoader wrote "
        f"beside its checkpoints ({PREFIX}/ under URL) and break the wall time, from the "
        "first process start to the last event (the idle time between runs of a finished "
        "job left out), into productive, data_wait, checkpoint_save, checkpoint_restore, "
        "startup, wasted, down and other.",
    )
    p.add_argument("url", help="the checkpoint root")
    p.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    p.add_argument(
        "--rank",
        type=int,
        help="one rank's timeline (default: the job's, each attempt as told by the rank "
        "whose events reach furthest: a rank SIGKILLed loses its last second of them)",
    )
    p.add_argument(
        "--job",
        help="whose attempts, where several jobs wrote under URL (the names it lists)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the timeline (matplotlib; a directory gets timeline.png)",
    )
    add_storage_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.rank is not None and args.rank < 0:
        raise CliError(f"--rank must be >= 0, got {args.rank}", code=2)
    store = open_existing(args.url, storage_options(args))
    log = read_log(store)
    found = jobs.split(log)
    if not found:
        raise CliError(
            f"no goodput events under {store.url_for(PREFIX)}: was the job run with goodput "
            "recording off (goodput=False, UNBROKEN_GOODPUT=0) or by an older unbroken?"
        )
    job = pick_job(found, args.job, store.url)
    for earlier, later, seconds in jobs.clock_overlaps(log, job):
        print(
            f"warning: attempt {later} starts {seconds:.1f} s before attempt {earlier} "
            "ended: two processes of the job ran at once (a replacement started before the "
            "old one ended) or the hosts' clocks disagree (a clock stepped, nodes out of NTP "
            "sync); the wall, down and goodput figures below are off by about that much",
            file=sys.stderr,
        )
    log = jobs.select(log, job)
    b = job_breakdown(log, args.rank)
    if not b.attempts:
        ranks = sorted({r for by_rank in log.values() for r in by_rank})
        raise CliError(f"no events of rank {args.rank} (ranks with events: {ranks})")
    plotted = None
    if args.plot:
        from unbroken.cli.plot import plot_timeline

        plotted = plot_timeline(b, args.plot)
    if args.json:
        print(json.dumps({"job": job.name, **b.as_dict()}, indent=1))
        if plotted:
            print(f"timeline: {plotted}", file=sys.stderr)
    else:
        print(render(b, job.name))
        if plotted:
            print(f"\ntimeline: {plotted}")
    return 0


def pick_job(found: list[jobs.Job], wanted: str | None, url: str) -> jobs.Job:
    """The job to report: ``--job``'s, or the newest (the one a user who ran a script
    twice asks about), the others named (their attempts mixed into one figure would mean
    nothing)."""
    listing = "; ".join(
        f"{j.name} ({len(j.attempts)} attempt{'' if len(j.attempts) == 1 else 's'}, "
        f"{_utc(j.start)} to {_utc(j.end)} UTC)"
        for j in found
    )
    if wanted is not None:
        for j in found:
            if j.name == wanted:
                return j
        raise CliError(f"no job {wanted!r} wrote under {url}; its jobs: {listing}", code=2)
    newest = max(found, key=lambda j: j.end)
    if len(found) > 1:
        print(
            f"note: {len(found)} jobs wrote goodput events under {url}: {listing}; this "
            f"is the newest, {newest.name}: pick another with --job NAME",
            file=sys.stderr,
        )
    return newest


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _ending(a: AttemptSummary, live: AttemptSummary | None) -> str:
    if a.clean:
        return "preempted" if a.preempted else "clean"
    return "no end yet" if a is live else "crashed"


LIVE_SECONDS = 180.0
"""A newest attempt without an end whose last event is this recent may still be running
(rank 0 flushes its events every 60 s by default): not called crashed."""


def render(b: Breakdown, job: str | None = None) -> str:
    restarts = f"{b.restarts} restart" + ("" if b.restarts == 1 else "s")
    runs = f"{b.runs} runs, " if b.runs > 1 else ""
    named = f", job {job}" if job else ""
    head = (
        f"goodput {b.goodput:.1%} of {text.duration(b.wall_seconds)} wall "
        f"({'the job' if b.rank is None else f'rank {b.rank}'}"
        f"{named}), {runs}{restarts}, {b.steps} steps ({b.wasted_steps} wasted)"
    )
    wall = b.wall_seconds or 1.0
    rows = [[c, f"{b.seconds[c]:.1f}", f"{b.seconds[c] / wall:.1%}"] for c in CATEGORIES]
    newest = b.attempts[-1] if b.attempts else None
    recent = newest is not None and time.time() - newest.end < LIVE_SECONDS
    live = newest if recent and newest is not None and not newest.clean else None
    cats = text.table(["category", "seconds", "share"], rows, right=(1, 2))
    att_rows = [
        [
            a.attempt,
            _utc(a.start),
            text.duration(a.end - a.start),
            f"{a.goodput:.1%}",
            f"{a.first_step}-{a.last_step}" if a.steps else "-",
            str(a.wasted_steps),
            "-" if a.restored_step is None else str(a.restored_step),
            _ending(a, live),
        ]
        for a in b.attempts
    ]
    atts = text.table(
        ["attempt", "started (UTC)", "ran", "goodput", "steps", "wasted", "restored", "ended"],
        att_rows,
    )
    stand_ins = [a for a in b.attempts if a.stand_in_rank is not None]
    note = "".join(
        f"\nattempt {a.attempt}: rank {b.rank} left no event; rank {a.stand_in_rank}'s stand in"
        for a in stand_ins
    )
    if live is not None:
        since = text.duration(time.time() - live.end)
        note += (
            f"\nattempt {live.attempt}: no end event, its last one {since} ago: still "
            "running (rank 0's events reach the store about once a minute, so the figures "
            "stop there and its last stretch counts as wasted until then), or killed"
        )
    return f"{head}\n\n{cats}\n\n{atts}{note}"
