"""``unbroken verify URL [--step N]``: every size and crc32c against the manifest.

The progress bar is tqdm's: one small pure-Python dependency that draws on stderr only
when it is a terminal, so ``--json`` and pipes stay clean (rich would bring a console
framework for one bar).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from unbroken._version import __version__
from unbroken.checkpoint.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, step_dir
from unbroken.cli.errors import STORE_UNREADABLE, CliError
from unbroken.cli.stores import add_storage_arguments, open_existing, storage_options
from unbroken.storage.errors import ObjectNotFoundError, StoreError, redact


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="re-checksum checkpoints against their manifests; exit 1 on any corruption",
        description="Check every file of the committed checkpoints under URL (or of --step "
        "N) against its manifest: present, the right size, the right crc32c. Exits 1 on "
        "any problem, naming the file; 3 if the store cannot be read (nothing checked).",
    )
    p.add_argument("url", help="the checkpoint root")
    p.add_argument("--step", type=int, default=None, help="only this step")
    p.add_argument("--json", action="store_true", help="print {step: [problems]} as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    store = open_existing(args.url, storage_options(args))
    unread: dict[int, str] = {}  # the store refused or did not answer: not checked
    infos = list_checkpoints(store, unreadable=unread)
    # Steps a newer unbroken wrote: this version cannot read their records to check them.
    newer = [i for i in infos if i.newer_format and args.step in (None, i.step)]
    infos = [i for i in infos if not i.newer_format]
    if args.step is not None:
        chosen = [i for i in infos if i.step == args.step]
        if newer:
            raise CliError(f"step {args.step} cannot be checked by unbroken {__version__}: "
                           f"{newer[0].problem}")  # fmt: skip
        if args.step in unread:
            raise CliError(f"step {args.step} under {store.url} could not be read: "
                           f"{unread[args.step]}", code=STORE_UNREADABLE)  # fmt: skip
        if not chosen:
            raise CliError(f"no checkpoint of step {args.step} under {store.url}")
    else:
        # Committed steps, and steps whose commit record is there but fails its checks (a
        # manifest edited or cut short: restore skips it, and that is corruption to report).
        chosen = [i for i in infos if i.committed or _damaged_record(store, i)]
        if not chosen and not unread:
            why = "only partial ones" if infos else "none at all"
            if newer:
                why = f"{len(newer)} written by a newer unbroken, which {__version__} cannot check"
            raise CliError(f"no committed checkpoint under {store.url} ({why})")
    total = sum(i.nbytes for i in chosen if i.committed)
    bar = _progress(total, disable=args.no_progress or args.json)
    report: dict[int, list[str]] = {}
    partial: set[int] = set()  # no commit record: a problem of the step, not of a file
    gone: set[int] = set()  # removed while this ran (a running job's retention)
    try:
        for info in chosen:
            bar.set_description(f"step {info.step}")
            if not info.committed and not _damaged_record(store, info):
                partial.add(info.step)
                report[info.step] = [info.problem or "not committed"]
                continue
            # "FILE: why" each, naming the file at fault (a shard cut short, not its record)
            try:
                problems = verify_checkpoint(store, info.step, deep=True, on_bytes=bar.update)
            except ObjectNotFoundError as exc:
                problems = [f"missing: {exc}"]
            except StoreError as exc:  # no verdict on this step; the others still count
                unread[info.step] = f"{type(exc).__name__}: {exc}"
                continue
            if problems and _removed_meanwhile(store, info.step):
                gone.add(info.step)  # a running job's retention: not damage
            report[info.step] = problems
    finally:
        bar.close()
    for step in gone:
        del report[step]
    bad = {s: p for s, p in report.items() if p}
    if args.json:
        unchecked = {s: [f"not checked: {why}"] for s, why in unread.items()}
        print(json.dumps({str(s): p for s, p in {**report, **unchecked}.items()}, indent=1))
    else:
        for step, problems in report.items():
            where = redact(store.url_for(step_dir(step)))
            for p in problems:
                if step in partial:  # a save cut short or still running: never restored
                    print(f"PARTIAL {where}: {p}; restore never uses such a step")
                else:
                    print(f"CORRUPT {where}/{p}")
            if not problems:
                print(f"ok      {where}")
        for info in newer:
            print(f"newer   {redact(info.url)}: not checked: {info.problem}")
        for step, why in sorted(unread.items()):
            print(f"UNREAD  {redact(store.url_for(step_dir(step)))}: not checked: {redact(why)}")
        for step in sorted(gone):
            print(f"gone    {redact(store.url_for(step_dir(step)))}: removed while verifying "
                  "(a running job's retention), not checked")  # fmt: skip
    if bad:
        n = sum(len(p) for p in bad.values())
        more = f"; {len(unread)} could not be read" if unread else ""
        raise CliError(f"{n} problem(s) in {len(bad)} checkpoint(s) under {store.url}{more}")
    if unread:  # nothing found wrong in what was read, but not everything was
        raise CliError(
            f"{len(unread)} checkpoint(s) under {store.url} could not be read (not checked): "
            f"{next(iter(unread.values()))}",
            code=STORE_UNREADABLE,
        )
    if gone and not report:  # nothing was checked: not a pass
        raise CliError(
            f"every checkpoint under {store.url} was removed while verifying (a running "
            "job's retention): nothing was checked; run it again, or pass --step N"
        )
    return 0


GONE_WAIT_SECONDS = 5.0
"""How long a step whose commit record vanished may take to be removed whole."""


def _removed_meanwhile(store, step: int) -> bool:
    """Retention removed the step since the listing: its commit record went first, then
    every file goes within moments. A record gone with the files left is damage."""
    if store.exists(f"{step_dir(step)}/{MANIFEST_NAME}"):
        return False
    deadline = time.monotonic() + GONE_WAIT_SECONDS
    while store.list(step_dir(step)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _damaged_record(store, info: CheckpointInfo) -> bool:
    """A step that is not committed although its manifest is there (and not one a newer
    unbroken wrote): the commit record itself is damaged."""
    if info.committed or info.newer_format:
        return False
    return store.exists(f"{step_dir(info.step)}/{MANIFEST_NAME}")


def _progress(total: int, *, disable: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=disable or None,  # None: only when stderr is a terminal
        leave=False,
    )
