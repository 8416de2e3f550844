"""Upload what earlier, dead attempts on this node logged locally but not durably.

A rank's event log reaches the durable tier every minute (rank 0) or only at its end (the
others), and its local copy in the staging tier every second: the next attempt on the
node uploads a dead attempt's local tail, so a crash loses about a second of events.
"""

from __future__ import annotations

import logging
import os
import socket

from unbroken._util.procs import process_alive, process_start_ticks
from unbroken.goodput.events import BEAT, PREFIX, START, Event, object_key, parse_lines, rank_prefix
from unbroken.storage import Store

log = logging.getLogger(__name__)


def salvage_local_logs(store: Store, staging_dir: str) -> int:
    """Upload what earlier, dead attempts on this node wrote locally but not durably.

    Each file is claimed by an atomic rename first, so ranks sharing the staging dir do
    not upload it twice. Returns the number of files salvaged.
    """
    local_dir = os.path.join(staging_dir, PREFIX)
    try:
        names = sorted(os.listdir(local_dir))
    except OSError:
        return 0
    salvaged = 0
    for name in names:
        path = os.path.join(local_dir, name)
        if not name.endswith(".jsonl") or not name.startswith("attempt-"):
            if ".claimed-" in name and not process_alive(*_claimer(name)):
                os.replace(path, path.split(".claimed-")[0])  # a salvager died: retry it
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                events = parse_lines(f.read(), path)
        except OSError:
            continue
        head = next((e for e in events if e.kind == START), None)
        if head is None:
            continue
        pid, host = head.info.get("pid"), head.info.get("host")
        if (
            host == socket.gethostname()
            and isinstance(pid, int)
            and process_alive(pid, head.info.get("started"))
        ):
            continue  # a live process's own log (not one that reuses its pid)
        claimed = f"{path}.claimed-{os.getpid()}-{process_start_ticks(os.getpid())}"
        try:
            os.rename(path, claimed)
        except OSError:
            continue  # another rank took it
        attempt, rank = head.info.get("attempt"), head.info.get("rank")
        if not isinstance(attempt, str) or not isinstance(rank, int):
            os.unlink(claimed)
            continue
        try:
            if not _of_this_history(store, attempt):
                log.info("goodput: %s dropped: the durable log holds neither its attempt nor "
                         "an earlier one (emptied since)", path)  # fmt: skip
                os.unlink(claimed)
                continue
            _upload_missing(store, attempt, rank, events)
        except Exception as exc:
            log.warning("goodput: could not salvage %s: %s", path, exc)
            os.replace(claimed, path)
            continue
        os.unlink(claimed)
        salvaged += 1
    return salvaged


def _of_this_history(store: Store, attempt: str) -> bool:
    """Whether the durable log holds ``attempt`` or one that started before it (attempt
    names begin with their start time, so keys sort by it). Neither: the URL was emptied
    since (the checkpoints deleted to start over), and a local copy the staging dir kept
    is of a history that is gone; uploaded, it showed the new run's report a crash of
    the old one. (Lost with it: a first attempt whose start never reached the durable
    tier at all, the tier down throughout its life.)"""
    mine = f"{PREFIX}/attempt-{attempt}/"
    for entry in store.list(PREFIX):  # sorted: the first is the oldest attempt's
        return entry.key < mine or entry.key.startswith(mine)
    return False


def _upload_missing(store: Store, attempt: str, rank: int, local: list[Event]) -> None:
    durable: list[Event] = []
    for entry in store.list(rank_prefix(attempt, rank)):
        text = store.read_bytes(entry.key).decode("utf-8", "replace")
        durable.extend(parse_lines(text, store.url_for(entry.key)))
    have = max((e.n for e in durable), default=-1)
    last_beat = max((e.t for e in durable), default=0.0)
    missing = [e for e in local if e.n > have]
    beats = [e for e in local if e.kind == BEAT and e.t > last_beat]
    if beats:
        missing.append(max(beats, key=lambda e: e.t))
    if missing:
        data = "".join(e.to_json() + "\n" for e in missing).encode()
        store.write_bytes(object_key(attempt, rank, have + 1), data)


def _claimer(name: str) -> tuple[int, str | None]:
    """The (pid, start ticks) a claimed file's name records."""
    pid, _, started = name.rsplit(".claimed-", 1)[1].partition("-")
    try:
        return int(pid), started if started not in ("", "None") else None
    except ValueError:
        return -1, None
