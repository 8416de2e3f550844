"""``unbroken``: the console script. Each verb lives in its own module."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from unbroken._version import __version__
from unbroken.cli import demo, goodput, ls, plan, verify
from unbroken.cli.errors import STORE_UNREADABLE, CliError
from unbroken.storage.errors import ObjectNotFoundError, StoreError, redact

VERBS = (ls, verify, goodput, plan, demo)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unbroken",
        description="Inspect checkpoints and the goodput of jobs run with unbroken.",
    )
    p.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 ok, 1 a failure (corruption, nothing found), 2 bad arguments, 3 the
    store could not be read (unreachable, timed out, refused): nothing was checked."""
    p = parser()
    args = p.parse_args(argv)
    if not hasattr(args, "run"):
        p.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    prog = f"unbroken {sys.argv[1] if argv is None and len(sys.argv) > 1 else ''}".strip()
    try:
        with warnings.catch_warnings():  # restores showwarning for an in-process caller
            warnings.showwarning = _one_line_warning(prog)
            return args.run(args)
    except CliError as exc:  # messages may quote the URL given, credentials and all
        print(f"{prog}: error: {redact(str(exc))}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # `unbroken ls URL | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a store or checkpoint error: one line, no traceback
        if os.environ.get("UNBROKEN_DEBUG"):
            raise
        print(f"{prog}: error: {type(exc).__name__}: {redact(str(exc))}", file=sys.stderr)
        unread = isinstance(exc, StoreError) and not isinstance(exc, ObjectNotFoundError)
        return STORE_UNREADABLE if unread else 1


def _one_line_warning(prog: str):
    """A library warning (a directory that is not a checkpoint) as the user sees it:
    ``unbroken ls: warning: ...``, not Python's source path and line."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"{prog}: warning: {redact(str(message))}", file=file or sys.stderr)

    return show


if __name__ == "__main__":
    sys.exit(main())
