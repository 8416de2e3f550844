"""Who writes a step: every job's identity, and the create-only claim on a step.

Two jobs saving the same step to one URL must not mix their files: the coordinator
claims ``step-N/writer.json`` create-only before any rank uploads, so the second job
skips the step (naming the first) instead of overwriting its shards. A claim left by a
crashed job on this host (its pid gone) is taken over; one left on another host is
reported with the way out (delete it, or let the job save the next step).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from unbroken._util.procs import pid_alive
from unbroken.checkpoint.errors import OtherWriterError
from unbroken.storage import ObjectExistsError, ObjectNotFoundError, Store

WRITER_NAME = "writer.json"
"""In a step directory: the claim of the job that writes the step (not in the manifest)."""
_PROCESS_STARTED = time.time()
"""When this process imported unbroken: with host and pid, it tells one job from another."""


def writer_identity() -> dict[str, Any]:
    """Who is saving: host, pid and start time of this process (in every manifest, so a
    job that loses a commit race can be told which job won it)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _PROCESS_STARTED}


def describe_writer(writer: Any) -> str:
    if not isinstance(writer, dict):
        return "an unknown writer (an older unbroken)"
    started = writer.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    return f"the job on host {writer.get('host')} pid {writer.get('pid')} (started {when})"


def claim_step(store: Store, step_prefix: str, step: int) -> None:
    """Claim the step for this job before any of its files are uploaded.

    Raises OtherWriterError naming the job that holds the claim if it is another one
    and may be alive."""
    key = f"{step_prefix}/{WRITER_NAME}"
    mine = writer_identity()
    for _ in range(3):
        try:
            store.write_bytes(key, json.dumps(mine).encode(), create_only=True)
            return
        except ObjectExistsError:
            pass
        try:
            other = json.loads(store.read_bytes(key))
        except ObjectNotFoundError:
            continue  # released meanwhile: try again
        except ValueError:
            other = None
        if other == mine:
            return  # this job's own claim (a retried save)
        if isinstance(other, dict) and _gone(other):
            store.delete(key)  # a crashed job on this host left it
            continue
        raise OtherWriterError(
            f"step {step} is being saved to {store.url_for(step_prefix)} by "
            f"{describe_writer(other)}: two jobs are saving to one URL, so this job skips "
            f"the step and leaves that job's files alone. If no such job runs any more, "
            f"delete {store.url_for(key)}.",
            step=step,
            url=store.url_for(key),
        )
    raise OtherWriterError(
        f"step {step}: could not claim {store.url_for(key)}", step=step, url=store.url_for(key)
    )


def _gone(writer: dict[str, Any]) -> bool:
    pid = writer.get("pid")
    return (
        writer.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and (pid == os.getpid() or not pid_alive(pid))
    )
