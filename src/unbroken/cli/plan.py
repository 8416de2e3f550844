"""``unbroken plan``: failure odds, expected goodput and the best checkpoint interval."""

from __future__ import annotations

import argparse
import json
import math

from unbroken.cli.argtypes import finite
from unbroken.cli.errors import CliError
from unbroken.goodput import planner


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a job: failure probability, expected goodput, optimal checkpoint interval",
        description="Give --gpus/--days/--afr for the chance that at least one GPU fails; "
        "--interruptions-per-day with --interval-minutes for the goodput to expect; "
        "--interruptions-per-day with --save-seconds (no interval) for the Young/Daly "
        "optimal interval.",
    )
    p.add_argument("--gpus", type=int, help="GPUs in the job")
    p.add_argument("--days", type=finite, help="the job's length in days")
    p.add_argument("--afr", type=finite, help="annual failure rate per GPU (0.01 = 1%%)")
    p.add_argument("--interruptions-per-day", type=finite, help="job interruptions per day")
    p.add_argument("--interval-minutes", type=finite, help="minutes between checkpoints")
    p.add_argument("--save-seconds", type=finite, help="seconds a save blocks the loop (0)")
    p.add_argument("--restart-seconds", type=finite, help="seconds a restart costs (0)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=run)


def compute(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    failure = (args.gpus, args.days, args.afr)
    if any(v is not None for v in failure):
        if any(v is None for v in failure):
            raise CliError("--gpus, --days and --afr go together", code=2)
        out["failure_probability"] = planner.failure_probability(*failure)
        out["expected_failures"] = planner.expected_failures(*failure)
    rate = args.interruptions_per_day
    save = args.save_seconds or 0.0
    restart = args.restart_seconds or 0.0
    if (args.interval_minutes is not None or args.save_seconds is not None) and rate is None:
        raise CliError("--interval-minutes and --save-seconds need --interruptions-per-day", code=2)
    if rate is not None:
        interval = args.interval_minutes
        if interval is not None and not interval > 0:
            raise CliError(f"--interval-minutes must be > 0, got {interval:g}", code=2)
        if interval is not None and not math.isfinite(interval * 60.0):
            raise CliError(f"--interval-minutes {interval:g} is too large to plan with", code=2)
        if interval is None:
            if not save:
                raise CliError(
                    "with --interruptions-per-day give --interval-minutes (expected goodput) "
                    "or --save-seconds > 0 (optimal interval)",
                    code=2,
                )
            seconds = planner.optimal_interval_seconds(save, planner.mtbf_seconds(rate))
            out["optimal_interval_minutes"] = seconds / 60.0
            interval = seconds / 60.0
        out["expected_goodput"] = planner.expected_goodput(
            rate, interval * 60.0, save_seconds=save, restart_seconds=restart
        )
    if not out:
        raise CliError("nothing to plan: see `unbroken plan --help`", code=2)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        out = compute(args)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from exc
    if args.json:
        print(json.dumps(out))
        return 0
    labels = {
        "failure_probability": ("P(at least one GPU fails)", "{:.1%}"),
        "expected_failures": ("expected GPU failures", "{:.2f}"),
        "optimal_interval_minutes": ("optimal checkpoint interval", "{:.1f} minutes"),
        "expected_goodput": ("expected goodput", "{:.1%}"),
    }
    for key, value in out.items():
        label, fmt = labels[key]
        if value >= 1e6:  # a figure of 150 digits says no more than its exponent
            fmt = fmt.replace(":.1f", ":.3g").replace(":.2f", ":.3g")
        text = fmt.format(value)
        if key == "optimal_interval_minutes" and value < 1:  # not "0.0 minutes"
            text = f"{value * 60:.3g} seconds"
        print(f"{label:<30} {text}")
    return 0
