"""Who writes a step: every job's identity, and the create-only claim on a step.

Two jobs saving the same step to one URL must not mix their files: the coordinator
claims ``step-N/writer.json`` create-only before any rank uploads, so the second job
skips the step (naming the first) instead of overwriting its shards. A claim found there
is judged by ``judge_claim``:

- another attempt of this job (the same job id, ``unbroken._util.job``: a torchrun
  restart, a Slurm requeue, a pod rescheduled on another host), or a process of this
  host that is gone (its pid dead, or reused by a process started at another time): it is
  stale, and taken over;
- a process of this host that still runs: another job, for sure (``OtherJobError``);
- anything else, on another host: no record proves such a writer dead (there are no
  leases). A claim made after this job first looked at the URL proves it alive
  (``OtherJobError``); an older one only skips the step, and the error says the way out
  (one job id for all attempts, or delete the claim).

A claim in a committed step is never taken over: the step is refused as committed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from unbroken._util.job import JOB_ID_ENV, job_id
from unbroken._util.procs import process_alive, process_start_ticks
from unbroken.checkpoint.errors import OtherJobError, OtherWriterError
from unbroken.storage import ObjectExistsError, ObjectNotFoundError, Store

WRITER_NAME = "writer.json"
"""In a step directory: the claim of the job that writes the step (not in the manifest)."""
_PROCESS_STARTED = time.time()
"""When this process imported unbroken: with host and pid, it tells one job from another."""

OURS, STALE, LIVE, UNPROVEN = "ours", "stale", "live", "unproven"
"""``judge_claim``'s verdicts: keep it, take it over, another job for sure, cannot tell."""


def writer_identity() -> dict[str, Any]:
    """Who is saving: host, pid, start time (wall clock, and the kernel's start ticks that
    tell a reused pid apart) and the job id its attempts share. In every claim and every
    manifest, so that a job that loses a claim or a commit is told which job won it."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": _PROCESS_STARTED,
        "ticks": process_start_ticks(pid),
        "job": job_id(),
    }


def describe_writer(writer: Any) -> str:
    if not isinstance(writer, dict):
        return "an unknown writer (an older unbroken)"
    started = writer.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    job = writer.get("job")
    who = f"the job {job!r}" if isinstance(job, str) and job else "the job"
    return f"{who} on host {writer.get('host')} pid {writer.get('pid')} (started {when})"


def judge_claim(other: Any, mine: dict[str, Any]) -> str:
    """What a claim found on a step is to this process (see the module's docstring)."""
    if other == mine:
        return OURS
    if not isinstance(other, dict):
        return UNPROVEN
    pid, job = other.get("pid"), other.get("job")
    if other.get("host") == mine["host"] and isinstance(pid, int) and pid > 0:
        if pid == mine["pid"]:
            return STALE  # this process under another name, or the one before it on the pid
        ticks = other.get("ticks")
        return LIVE if process_alive(pid, ticks if isinstance(ticks, str) else None) else STALE
    if isinstance(job, str) and job and job == mine["job"]:
        return STALE  # an earlier attempt of this job, on another host
    return UNPROVEN


def other_holder(store: Store, step_prefix: str) -> str | None:
    """Who else may still be saving this uncommitted step, described; None where its
    files are this job's to remove (its own claim, a stale one, or no claim at all).

    Retention removes the partial steps older than the newest commit: a crashed save's
    leftovers. Another job on the same URL may be uploading one of them right now, and
    commit it a moment later; its claim says so, and then the step is left alone."""
    try:
        other = json.loads(store.read_bytes(f"{step_prefix}/{WRITER_NAME}"))
    except ObjectNotFoundError:
        return None
    except ValueError:
        other = None
    if judge_claim(other, writer_identity()) in (OURS, STALE):
        return None
    return describe_writer(other)


def claim_step(store: Store, step_prefix: str, step: int, *, seen_before: bool = True) -> None:
    """Claim the step for this job before any of its files are uploaded.

    ``seen_before``: whether a claim on this step was there when this job first looked
    at the URL (False proves that whoever made a claim found now was alive since).
    Raises OtherJobError when another job provably saves to this URL, OtherWriterError
    when a claim of another job or of an unnamed one on another host holds the step."""
    from unbroken.checkpoint.format.manifest import MANIFEST_NAME  # which imports this

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
        verdict = judge_claim(other, mine)
        if verdict == OURS:
            return  # this process's own claim (a retried save)
        if verdict == STALE and not store.exists(f"{step_prefix}/{MANIFEST_NAME}"):
            store.delete(key)  # a crashed process of this host or attempt of this job left it
            continue
        raise _refusal(store, step_prefix, step, other, mine, verdict, seen_before)
    raise OtherWriterError(
        f"step {step}: could not claim {store.url_for(key)}", step=step, url=store.url_for(key)
    )


def _refusal(
    store: Store,
    step_prefix: str,
    step: int,
    other: Any,
    mine: dict[str, Any],
    verdict: str,
    seen_before: bool,
) -> OtherWriterError:
    url, where = store.url_for(f"{step_prefix}/{WRITER_NAME}"), store.url_for(step_prefix)
    holder, me = describe_writer(other), describe_writer(mine)
    if verdict == STALE:  # taken over, but the step is committed meanwhile
        return OtherWriterError(
            f"step {step} is already committed at {where} (its claim names {holder}); a "
            "committed checkpoint is never overwritten",
            step=step,
            url=url,
        )
    if verdict == LIVE or not seen_before:
        proof = (
            "its process runs on this host"
            if verdict == LIVE
            else "its claim was made after this job first looked at the URL"
        )
        return OtherJobError(
            f"two jobs are saving to {store.url_for('')}: step {step} is claimed by "
            f"{holder}, which is alive ({proof}); this job is {me}. Each skips the other's "
            "steps and would restore the other's checkpoints: give each job its own URL.",
            step=step,
            url=url,
            this_job=me,
            other_job=holder,
        )
    unnamed = not (isinstance(other, dict) and other.get("job")) or not mine["job"]
    way_out = f"If no such job runs any more, delete {url}."
    if unnamed:
        way_out = (
            "If it was an earlier attempt of this job, give the attempts one identity (set "
            f"{JOB_ID_ENV}, or launch under Slurm, or torchrun with --rdzv-id) and they take "
            f"over each other's claims; or delete {url}."
        )
    return OtherWriterError(
        f"step {step} is being saved to {where} by {holder}, not by this job ({me}): two "
        "jobs are saving to one URL, or a job on another host left this claim when it "
        f"stopped; this job skips the step and leaves those files alone. {way_out}",
        step=step,
        url=url,
    )


def live_committer(store: Store, step: int) -> OtherJobError | None:
    """An OtherJobError when ``step``, committed at the URL, was written by another process
    alive on this host: two jobs on one URL, not a run to go on from (restore) or an
    earlier one (a URL of its own); None when that cannot be told."""
    from unbroken.checkpoint.format.manifest import read_manifest, step_dir  # imports this

    try:
        writer = read_manifest(store, step).extra.get("writer")
    except Exception:
        return None
    mine = writer_identity()
    if judge_claim(writer, mine) != LIVE:
        return None
    holder, me = describe_writer(writer), describe_writer(mine)
    return OtherJobError(
        f"two jobs are saving to {store.url_for('')}: step {step} was committed by {holder}, "
        f"which is alive (its process runs on this host); this job is {me}. Each skips the "
        "other's steps and would restore the other's checkpoints: give each job its own URL.",
        step=step,
        url=store.url_for(step_dir(step)),
        this_job=me,
        other_job=holder,
    )
