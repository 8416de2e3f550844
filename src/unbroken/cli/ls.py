"""``unbroken ls URL``: the checkpoints under a URL, committed or partial and why."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from unbroken.checkpoint.catalog import CheckpointInfo, list_checkpoints
from unbroken.cli import text
from unbroken.cli.errors import CliError
from unbroken.cli.stores import add_storage_arguments, open_existing, storage_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls",
        help="list checkpoints: step, committed or partial (and why), size, age",
        description="List every checkpoint under URL (a path or a store URL such as "
        "s3://bucket/run/checkpoints), committed or partial, and why a partial one is.",
    )
    p.add_argument("url", help="the checkpoint root (what CheckpointManager was given)")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    add_storage_arguments(p)
    p.set_defaults(run=run)


def _state(info: CheckpointInfo) -> str:
    if info.committed:
        return "committed"
    return "newer" if info.newer_format else "damaged" if info.damaged else "partial"


def run(args: argparse.Namespace) -> int:
    store = open_existing(args.url, storage_options(args))
    infos = list_checkpoints(store)
    if args.json:
        print(json.dumps([dataclasses.asdict(i) for i in infos], indent=1))
    elif infos:
        now = time.time()
        rows = [
            [
                str(i.step),
                _state(i),
                text.size(i.nbytes),
                text.age(now - i.created) if i.created is not None else "-",
                str(i.world_size) if i.world_size is not None else "-",
                i.problem or "",
            ]
            for i in infos
        ]
        print(text.table(["step", "state", "size", "age", "ranks", "problem"], rows))
    if not infos:
        raise CliError(f"no checkpoints under {store.url}")
    return 0
