"""``unbroken demo``: the main job on 2 ranks, trained through crashes (see unbroken.demo)."""

from __future__ import annotations

import argparse

from unbroken.cli.errors import CliError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from unbroken.demo.run import __doc__ as about
    from unbroken.demo.run import add_arguments

    p = sub.add_parser(
        "demo",
        help="train a small job on 2 ranks through crashes and show its goodput",
        description=about,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from unbroken.demo.run import main

    check_together(args)
    return main(args)


def check_together(args: argparse.Namespace) -> None:
    """The numbers that are wrong only together, refused before anything starts."""
    if args.step_seconds > 60:
        raise CliError(f"--step-seconds {args.step_seconds:g}: at most 60", code=2)
    if args.every_steps >= args.steps:
        raise CliError(f"--every-steps {args.every_steps} must be below --steps {args.steps}: "
                       "no save would come before the end", code=2)  # fmt: skip
    if args.kills and args.steps < 3 * args.every_steps:
        raise CliError(
            f"--kills {args.kills} needs --steps of at least 3x --every-steps ("
            f"{3 * args.every_steps}): a kill waits for a commit and stays out of the last "
            "interval",
            code=2,
        )
