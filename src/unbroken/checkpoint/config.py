"""What a CheckpointManager is told (CheckpointConfig) and what it counts (SaveStats).

Kept apart from the manager so the options, their defaults and their checks read in one
place; ``docs/checkpoints.md`` mirrors this file.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from unbroken._util.staging_base import default_staging_base
from unbroken.storage import RetryPolicy


@dataclass
class CheckpointConfig:
    """Everything a CheckpointManager is told; every rank must be given the same."""

    url: str
    """Durable tier: a path or any store URL (``s3://...``, ``emulated::...``)."""
    staging_dir: str | None = None
    """Local fast tier. None: ``$UNBROKEN_STAGING_DIR`` or the temp dir, one subdirectory
    per durable URL, so a restarted job finds its own local copy."""
    every_steps: int | None = 500
    """maybe_save saves when ``step % every_steps == 0`` (step 0 never)."""
    every_seconds: float | Literal["auto"] | None = None
    """maybe_save also saves when this long has passed since the last save started. On
    several ranks rank agreement costs one tiny all_reduce per maybe_save call. "auto":
    the Young/Daly optimum ``sqrt(2 * C * MTBF)`` from the measured cost of a save to
    the loop and the job's failure rate (``mtbf``, or its own event log), never shorter
    than a save takes to commit (see ``unbroken.goodput.autopilot``)."""
    mtbf: float | None = None
    """With ``every_seconds="auto"``: the job's mean time between failures in seconds.
    None: estimated from the failures of its earlier attempts (the event log), with a
    prior of one failure an hour that fades as the job runs without one."""
    keep_last: int | None = 3
    """Committed checkpoints kept in the durable tier (None: all)."""
    keep_every_steps: int | None = None
    """Also keep every committed checkpoint whose step is a multiple of this."""
    async_save: bool = True
    """False: save() returns only once the checkpoint is committed."""
    storage_options: dict[str, Any] | None = None
    """Passed to ``open_store`` for the durable tier."""
    when_busy: Literal["skip", "wait"] = "skip"
    """What maybe_save does when a save is due while the previous one is still in flight:
    skip this one (training never waits) or wait for the previous one. save() always waits."""
    raise_on_failure: bool = False
    """Raise SaveFailedError from maybe_save/save when a background save failed (default:
    warn there; wait() and close() always raise)."""
    upload_streams: int = 4
    """Parallel uploads per rank."""
    staging_max_bytes: int | None = None
    """Bound on the host staging buffers (None: whatever one copy of the state needs)."""
    staging_shared_memory: bool = False
    """Host staging buffers of CPU tensors in shared memory, for code that hands them to
    another process. Default: private memory with huge pages advised, which the worker
    writes out with less kernel work (see ``unbroken._util.host_memory``)."""
    memory_tier: bool | None = None
    """Keep the node's copy of the newest committed checkpoint in shared memory (a
    tmpfs: ``$UNBROKEN_MEMORY_DIR`` or ``/dev/shm``), in place of the disk staging tier,
    so a process restarted on the node restores at about the speed of a memory copy.
    It holds two snapshots per rank (the committed one and the one being written) and
    leaves a tenth of the tmpfs free (at most 4 GiB). None: on where the tmpfs can hold
    that (off, with one warning, where it cannot: Docker's default /dev/shm is 64 MB);
    True: that failing is an error; False: the disk staging tier only."""
    replicas: int = 1
    """On a job of several nodes, each node's committed snapshot is copied in the
    background from its memory tier into the memory tier of this many other nodes (the
    next ones by node index), so that a node that is lost and replaced restores from a
    peer's memory rather than the durable tier. A replica counts against the receiving
    node's tmpfs and is dropped first when the node's own saves need the room. Each
    node's lowest rank runs a server for it (``checkpoint/peers/``, docs/launch.md).
    0: no replicas and no servers."""
    save_helper: bool = True
    """Upload each save whose node copy is in the memory tier from a helper process of
    this rank's own, where the durable tier is an object store: the uploads' threads
    and HTTP client then take no turn of the training process's interpreter. The helper
    ends with its process; a helper that dies fails the save it was uploading, and the
    next save starts a new one. False: the uploads run on threads of this process."""
    timeout: float = 1800.0
    """Seconds a background collective may wait for a peer before failing the save."""
    retry: RetryPolicy | None = None
    """How hard the durable tier retries a transient failure (None: the store default)."""
    goodput: bool = True
    """Record this job's goodput events beside the checkpoints (``unbroken goodput URL``);
    also off with ``UNBROKEN_GOODPUT=0``."""
    mlflow: bool = True
    """With ``MLFLOW_TRACKING_URI`` set or an MLflow run active, rank 0 logs the loop's
    figures (fetch_seconds, checkpoint times, cache hit ratio, goodput) to that run every
    ``UNBROKEN_MLFLOW_EVERY_STEPS`` (50) steps, from a thread; also off with
    ``UNBROKEN_MLFLOW=0``."""
    preemption: Literal["exit", "flag", "off"] = "exit"
    """On SIGTERM (a scheduler about to take the node), the next maybe_save saves the step
    reached, on every rank alike, and waits for its commit. Then "exit" ends the process
    (``SystemExit(143)``), "flag" only sets ``mgr.preempted`` for a loop that stops
    itself, "off" installs no handler. A handler installed before keeps running."""

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep_last", "keep_every_steps", "upload_streams"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"CheckpointManager: {name} must be a positive int, got {value!r}")
        if self.every_seconds == "auto":
            if self.mtbf is not None:
                check_seconds("CheckpointManager: mtbf", self.mtbf, zero=False)
        else:
            if self.every_seconds is not None and (
                isinstance(self.every_seconds, (str, bool))
                or not isinstance(self.every_seconds, (int, float))
                or not math.isfinite(self.every_seconds)
                or self.every_seconds <= 0
            ):
                raise ValueError(
                    "CheckpointManager: every_seconds must be a finite number of seconds > 0 "
                    f"or 'auto', got {self.every_seconds!r}"
                )
            if self.mtbf is not None:
                raise ValueError(
                    "CheckpointManager: mtbf is read only with every_seconds='auto'; got "
                    f"mtbf={self.mtbf!r} with every_seconds={self.every_seconds!r}"
                )
        if self.preemption not in ("exit", "flag", "off"):
            raise ValueError(
                "CheckpointManager: preemption must be 'exit', 'flag' or 'off', got "
                f"{self.preemption!r}"
            )
        if self.when_busy not in ("skip", "wait"):
            raise ValueError(
                f"CheckpointManager: when_busy must be 'skip' or 'wait', got {self.when_busy!r}"
            )
        check_seconds("CheckpointManager: timeout", self.timeout, zero=False)
        if not isinstance(self.save_helper, bool):
            raise ValueError(
                f"CheckpointManager: save_helper must be True or False, got {self.save_helper!r}"
            )
        if (
            not isinstance(self.replicas, int)
            or isinstance(self.replicas, bool)
            or (self.replicas < 0)
        ):
            raise ValueError(
                f"CheckpointManager: replicas must be an int >= 0, got {self.replicas!r}"
            )
        if self.memory_tier not in (None, True, False):
            raise ValueError(
                "CheckpointManager: memory_tier must be None (on where it fits), True or "
                f"False, got {self.memory_tier!r}"
            )


@dataclass
class SaveStats:
    """Counters of one manager; ``seconds_*`` are sums over saves."""

    requested: int = 0
    """Saves that were due (maybe_save) or asked for (save)."""
    started: int = 0
    committed: int = 0
    failed: int = 0
    skipped_busy: int = 0
    """Due saves skipped because the previous one was still in flight."""
    waited_busy: int = 0
    """Saves that waited for the previous one to finish."""
    skipped_committed: int = 0
    """Saves of a step that is already committed (never overwritten)."""
    seconds_blocked: float = 0.0
    """Training-loop time spent inside save/maybe_save (staging start, busy waits)."""
    seconds_waited_busy: float = 0.0
    seconds_in_wait: float = 0.0
    """Time spent in wait() (the caller asked to block)."""
    seconds_staging_copy: float = 0.0
    """The staging copies' background part (overlapped with training; the optimizer
    step waits for what is left of it), checks included."""
    seconds_staging_check: float = 0.0
    """Of ``seconds_staging_copy``, the check that no source was written while it was
    copied (each source compared with its buffer; for CUDA sources, on the device)."""
    last_commit_seconds: float | None = None
    """From save() to committed, for the newest committed save."""
    last_phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes_committed: int = 0
    bytes_direct: int = 0
    """This rank's shard bytes written to the staging tier with O_DIRECT (no page cache),
    summed over saves; stays 0 where that file system refuses O_DIRECT."""
    bytes_from_memory: int = 0
    """This rank's bytes uploaded straight from the host buffers instead of being read
    back from the staging tier, summed over saves; stays 0 where the durable store reads
    files (object stores, for now)."""
    bytes_checksummed_in_copy: int = 0
    """This rank's shard bytes whose crc32c the staging copy took as it copied them (from
    the cache), so that the local write did not read them again; summed over saves."""
    replicas_sent: int = 0
    """Committed steps whose files this rank copied into every replica node's memory."""
    replicas_failed: int = 0
    """Committed steps whose replica did not reach every replica node (logged once per
    peer and cause; the durable tier holds them)."""
    bytes_replicated: int = 0
    """This rank's bytes sent to replica nodes, summed over saves."""
    bytes_staged_in_place: int = 0
    """This rank's shard bytes staged straight into the memory tier's file (from the
    second save of a state on), which the local write then did not copy; summed."""

    def count_done(self, job: Any) -> None:
        """A finished :class:`~unbroken.checkpoint.save_job.SaveJob`'s figures (the
        manager's worker thread, under the manager's lock)."""
        self.last_phase_seconds = dict(job.seconds)
        copy = job.staged.stats if job.staged is not None else {}
        self.seconds_staging_copy += copy.get("background_seconds", 0.0)
        self.seconds_staging_check += copy.get("verify_seconds", 0.0)
        self.bytes_direct += job.direct_bytes
        self.bytes_from_memory += job.memory_bytes
        self.bytes_checksummed_in_copy += job.checksummed_in_copy_bytes
        self.bytes_staged_in_place += job.in_place_bytes
        if job.error is not None:
            self.failed += 1
        else:
            self.committed += 1
            self.last_commit_seconds = job.seconds.get("total")
            self.bytes_committed += job.manifest.nbytes

    def count_replica(self, _step: int, nbytes: int, ok: bool) -> None:
        """The replicator's report on one step (its thread alone writes these counters)."""
        self.bytes_replicated += nbytes
        if ok:
            self.replicas_sent += 1
        else:
            self.replicas_failed += 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_option_names(names: Iterable[str], who: str = "CheckpointManager") -> None:
    """Refuse a name that is no option of the manager: a typo (``every_step=``) raises
    where it is written, not as the default it silently leaves in place."""
    known = [f.name for f in fields(CheckpointConfig) if f.name != "url"]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise TypeError(
            f"{who} got unknown options {unknown}; CheckpointManager takes: {', '.join(known)}"
        )


def default_staging_dir(url: str) -> str:
    """A per-job local directory, stable across restarts of the same job."""
    base = default_staging_base()
    key = url if "://" in url or "::" in url else os.path.abspath(url)
    return os.path.join(base, hashlib.sha1(key.encode()).hexdigest()[:16])


def check_seconds(what: str, value: Any, *, zero: bool) -> None:
    """A finite number of seconds, above zero (or at it, where ``zero``)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        least = "a non-negative" if zero else "a positive"
        raise ValueError(f"{what} must be {least}, finite number of seconds, got {value!r}")
