"""``unbroken demo``: the main job on 2 ranks, trained through crashes (see unbroken.demo)."""

from __future__ import annotations

import argparse


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

    return main(args)
