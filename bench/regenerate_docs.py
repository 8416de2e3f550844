"""Rerun the benchmarks a doc quotes and put their fresh output in place.

A doc names each benchmark it quotes beside the output, in a block of this shape::

    <!-- bench: python -m bench.peers.loaders --profile both --plot docs/img -->
    ```text
    (what that command printed, the JSON line left out)
    ```
    <!-- /bench -->

so a reader sees the command that made every table, and this script makes them again:
it runs each block's command with this interpreter, from the repository root, and writes
its output into the block, under a first line saying when, on what machine and how long
it took: each block its own, since ``--only`` reruns some and leaves the others as they
were. Plots come from the commands themselves (``--plot``).

    python -m bench.regenerate_docs [docs/benchmarks.md] [--only bench.peers] [--list]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys

from bench.common.paths import ROOT, child_env

BLOCK = re.compile(
    r"(?P<open><!-- bench: (?P<command>.+?) -->\n)(?P<body>.*?)(?P<close><!-- /bench -->)",
    re.DOTALL,
)


def blocks(text: str) -> list[str]:
    """The commands of every block, in order."""
    return [m.group("command") for m in BLOCK.finditer(text)]


def fill(text: str, outputs: dict[str, str]) -> str:
    """``text`` with each block whose command is in ``outputs`` holding that output."""

    def replace(m: re.Match[str]) -> str:
        command = m.group("command")
        if command not in outputs:
            return m.group(0)
        return f"{m.group('open')}```text\n{outputs[command].rstrip()}\n```\n{m.group('close')}"

    return BLOCK.sub(replace, text)


def keep_table(stdout: str) -> str:
    """What a reader needs from a benchmark's stdout: everything but its JSON lines."""
    return "\n".join(line for line in stdout.splitlines() if not line.lstrip().startswith("{"))


def machine() -> str:
    cores = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
        memory = f", {mem_kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    import torch

    system = f"Linux {platform.release()}, torch {torch.__version__}"
    return f"{platform.machine()}, {cores} cores{memory}, {system}"


def stamp(started: datetime.datetime, seconds: float) -> str:
    """The block's first line: when it was measured, on what, and how long it took."""
    return f"measured {started:%Y-%m-%d %H:%M} UTC on {machine()}; {seconds / 60:.0f} min"


def run(command: str) -> str | None:
    """The table ``command`` printed under its stamp, or None (said on stderr) if it failed."""
    argv = shlex.split(command)
    if argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    print(f"running: {command}", file=sys.stderr, flush=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    done = subprocess.run(argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"`{command}` failed (exit {done.returncode}): its block is unchanged",
              file=sys.stderr)  # fmt: skip
        return None
    seconds = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    return f"{stamp(started, seconds)}\n{keep_table(done.stdout)}"


def write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("doc", nargs="?", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    parser.add_argument("--only", action="append", default=[], help="commands containing this")
    parser.add_argument("--list", action="store_true", help="print the commands and stop")
    args = parser.parse_args()
    with open(args.doc) as f:
        text = f.read()
    commands = [c for c in blocks(text) if not args.only or any(o in c for o in args.only)]
    if args.list:
        print("\n".join(commands))
        return
    if not commands:
        raise SystemExit(f"{args.doc}: no <!-- bench: ... --> block matches {args.only}")
    failed = []
    for command in commands:  # each block lands as soon as it is made: a later failure
        output = run(command)  # (or a Ctrl-C) loses none of the runs before it
        if output is None:
            failed.append(command)
            continue
        with open(args.doc) as f:  # read again: the doc may have been edited meanwhile
            text = f.read()
        write(args.doc, fill(text, {command: output}))
    done = len(commands) - len(failed)
    print(f"{args.doc}: {done} of {len(commands)} block(s) regenerated", file=sys.stderr)
    if failed:
        raise SystemExit(f"failed, blocks unchanged: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
