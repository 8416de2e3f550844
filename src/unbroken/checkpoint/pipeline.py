"""The background half of a save: local tier -> durable tier -> commit -> retention.

One worker thread per manager runs one :class:`SaveJob` at a time, at lowered CPU and I/O
priority. Every rank runs the same sequence of collectives on the manager's dedicated
gloo group for every job, whatever happens locally: a rank that failed sends a
description of its error where others send results, so nobody deadlocks and nothing is
committed. The coordinator writes ``manifest.json`` (the commit record) last, only after
every rank has reported its files durable.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from unbroken._util.priority import lower_thread_priority
from unbroken._util.sizes import format_size
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint import staging_tier
from unbroken.checkpoint.collectives import Group
from unbroken.checkpoint.commit import commit_step, conflict_fields, generator_digests
from unbroken.checkpoint.durable_index import DurableIndex
from unbroken.checkpoint.durable_prune import prune_durable
from unbroken.checkpoint.errors import OtherJobError, SaveFailedError
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    committed_by,
    crc32c_bytes,
    step_dir,
)
from unbroken.checkpoint.format.planners import PinnedSavePlanner
from unbroken.checkpoint.format.shard_layout import TensorLayout
from unbroken.checkpoint.format.writer import TierWriter
from unbroken.checkpoint.format.writers import claim_step
from unbroken.checkpoint.local_writes import LOCAL_LOAN, LocalWrites
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.peers.replica_files import drop_all as drop_replicas
from unbroken.checkpoint.peers.replicator import Replica, Replicator
from unbroken.checkpoint.save_helper.uploads import HelperSlot
from unbroken.checkpoint.save_job import (
    SaveJob,
    describe,
    drop_frame_locals,
    lend_until_read,
    rng_file,
)
from unbroken.checkpoint.staging.arena import Arena, RankArenas
from unbroken.checkpoint.staging.owner import claim_staging_dir
from unbroken.storage import LocalStore, Store
from unbroken.storage.errors import RetriesExhaustedError, StoreError, redact
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.retry import RetryPolicy

log = logging.getLogger(__name__)

# DCP says so on every single-process save and load; no group is our normal case there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or")

MANIFEST = MANIFEST_NAME
_CLAIM_RETRY = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.05)


class _PhaseFailed(Exception):
    """A phase failed on some rank; ``args[0]`` says where and why, ``conflict`` (the
    fields of an OtherJobError, as every rank got them) that another job is the cause."""

    def __init__(self, message: str, conflict: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.conflict = conflict


@dataclass
class PipelineConfig:
    """How the background half of a save behaves."""

    keep_last: int | None
    """Committed checkpoints to keep in the durable tier (None keeps all)."""
    keep_every_steps: int | None
    """Also keep every checkpoint whose step is a multiple of this."""
    upload_streams: int = 4
    """Parallel uploads per rank."""
    lower_priority: bool = True
    """Renice the worker thread and lower its I/O priority."""
    save_helper: bool = True
    """Upload a save whose node copy is in the memory tier from a process of its own
    (``save_helper/``), where the durable tier is an object store."""
    stage_in_place: bool = True
    """Stage into the memory tier's files themselves (``staging/arena.py``), so that
    the staging buffers and the node's copy being written are the same memory."""


REPLICA_CLOSE_SECONDS = 10.0
"""How long close() lets the last commit's replica go on before it stops it."""


class SavePipeline:
    """Runs save jobs one at a time in a background thread."""

    def __init__(
        self,
        durable: Store,
        staging_dir: str,
        group: Group,
        config: PipelineConfig,
        on_done: Callable[[SaveJob], None],
        memory: MemoryTier | None = None,
        replicator: Replicator | None = None,
        on_arena: Callable[[TensorLayout], None] | None = None,
    ) -> None:
        self.durable = durable
        self.replicator = replicator
        """Sends each commit's files from the memory tier to the replica nodes."""
        self.staging_dir = staging_dir
        self.memory = memory
        """The node's memory tier: where a save's local copy goes while it has room."""
        self._release_staging = claim_staging_dir(
            staging_dir, group.global_rank, f"saving to {redact(durable.url)}"
        )
        self.local = LocalStore(staging_dir)
        self._stores = {staging_dir: self.local}
        if memory is not None:
            self._stores[memory.path] = LocalStore(memory.path)
        # Versions before O_DIRECT staging kept superseded shards here between saves.
        shutil.rmtree(os.path.join(staging_dir, ".spare"), ignore_errors=True)
        self.index = DurableIndex(durable)
        """The coordinator's view of the durable tier's committed steps."""
        self.group = group
        self.config = config
        self._on_done = on_done
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._jobs: list[SaveJob] = []  # submitted, not yet committed or failed
        self._lock = threading.Lock()
        self._pending = 0
        self._told_page_cache = False
        self.current_step: int | None = None
        """The step this run is at: its last commit, or what the manager restored. Its
        copy is the one the staging tier keeps (``staging_tier.tidy``)."""
        self._idle = threading.Condition(self._lock)
        self.arenas = (
            RankArenas(memory.path, group.global_rank)
            if memory is not None and config.stage_in_place
            else None
        )
        """This rank's files of the memory tier that saves stage straight into."""
        self._layout: TensorLayout | None = None
        """This rank's shard as the last save wrote it to the memory tier."""
        self._on_arena = on_arena
        """Told, before an arena of a layout is made, that the next saves stage its
        tensors there (the stager drops its own buffers of them)."""
        self._arena_ready = True
        """The last ``prepare`` left an arena ready (or had nothing to make)."""
        self.helpers = HelperSlot(self.durable, self.memory, self.config)
        """The process that uploads saves whose node copy is in the memory tier (none:
        the uploads run on threads here), started by the worker thread as it starts."""
        self._thread = threading.Thread(target=self._loop, name="unbroken-ckpt", daemon=True)
        self._thread.start()

    # -- foreground side -------------------------------------------------------------

    def memory_store(self) -> LocalStore | None:
        """The memory tier as a store, for restore (None: no memory tier)."""
        return self._stores.get(self.memory.path) if self.memory is not None else None

    def arena(self) -> Arena | None:
        """Where the next snapshot can stage in the memory tier: a file of this rank's
        laid out as its last shard there, made after that save's local write, once no
        step or snapshot holds it; None otherwise. Ask once the previous snapshot is
        released (``StateStager.stage(arena=...)`` does)."""
        if self.arenas is None or self.memory is None or not self.memory.active:
            return None
        return self.arenas.take(self._layout)

    def submit(self, job: SaveJob) -> None:
        """Queue a job; the worker runs jobs one at a time, in order.

        A job may be queued while the previous one still uploads: its staging has
        finished by then (the stager lends its buffers to one snapshot at a time, and the
        previous job returned them after its local write, or where the durable store sends
        from memory, once that store had read them; the transfer itself may go on)."""
        with self._lock:
            self._jobs.append(job)
            self._pending += 1
        self._queue.put(job)

    @property
    def in_flight(self) -> SaveJob | None:
        """The newest job not yet finished (committed and its retention done, or failed)."""
        with self._lock:
            return self._jobs[-1] if self._jobs else None

    def wait(self, timeout: float | None = None) -> None:
        """Until every queued job is committed, and its retention done, or failed: what the
        durable tier holds then is what the job leaves there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                raise TimeoutError(
                    f"checkpoint of step {job.step} still in flight after {timeout}s"
                )

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Until the newest commit's replica is sent (or given up); False on timeout."""
        return self.replicator is None or self.replicator.wait(timeout)

    def drain(self) -> None:
        """Until every submitted job and its retention are finished."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self, *, replica_seconds: float = REPLICA_CLOSE_SECONDS) -> None:
        """Finish every job and its retention, then stop the worker. ``replica_seconds``:
        how long the last commit's replica may still go on (a clean end: none)."""
        self._queue.put(None)
        self._thread.join()
        if self.replicator is not None:  # the last commit's replica, briefly waited for
            self.replicator.close(timeout=replica_seconds)
        self.helpers.close()
        if self.arenas is not None:
            self.arenas.close()
        self._release_staging()

    # -- worker side -----------------------------------------------------------------

    def _loop(self) -> None:
        name_native_thread()
        if self.config.lower_priority:
            lower_thread_priority()
        self.helpers.get()  # starts while the job restores and trains its first steps
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.manifest = self._save(job)
            except _PhaseFailed as e:
                message = f"checkpoint save of step {job.step} failed: {e.args[0]}"
                if e.conflict is not None:  # never heals: the manager raises it
                    job.error = OtherJobError(**{**e.conflict, "message": message})
                else:
                    job.error = SaveFailedError(job.step, message=message)
                job.error.__cause__ = e.__cause__
            except BaseException as e:  # a bug of ours must not vanish in a thread
                log.exception("checkpoint worker: unexpected error at step %d", job.step)
                job.error = SaveFailedError(job.step, e)
            finally:
                job.staged.release()  # idempotent; covers a failure before the local write
            if job.error is not None:
                drop_frame_locals(job.error)
                for root in self._stores:
                    staging_tier.remove_unfinished(root, job.step)
            job.seconds["total"] = time.monotonic() - job.submitted
            try:
                self._on_done(job)  # before the job leaves _jobs: wait() then sees its error
                if job.manifest is not None:  # housekeeping, before the next job starts
                    self._after_commit(job.manifest)
                    self._replicate(job)
                self._prepare_arenas()  # the tidy may have freed an older step's
            finally:
                with self._lock:
                    self._jobs.remove(job)
                job.done.set()  # after retention: wait() leaves what a reader will find
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _prepare_arenas(self, *, spare: bool = True) -> None:
        """Make the arenas the next saves stage in, the stager's own buffers of the same
        tensors dropped first: a rank holds the state twice in host memory, never three
        times (its first save's buffers, that save's copy in the tier, the next arena;
        or, at its second save, the first save's copy, the second's and a spare)."""
        if self.arenas is None:
            return
        layout, tier, tell = self._layout, self.memory, self._on_arena
        # After a failed make the stager keeps its buffers (they would be made again
        # each save) until an arena is ready again.
        if layout and tier and tier.active and tell and self._arena_ready:
            tell(layout)
        self._arena_ready = self.arenas.prepare(layout, spare=spare)

    def _agree(self, problem: str | None, what: str, exc: BaseException | None) -> None:
        """Raise on every rank if ``problem`` is set on any rank (``exc``: this rank's)."""
        gathered = self._together(what, self.group.all_gather, (problem, conflict_fields(exc)))
        conflict = next((c for _, c in gathered if c is not None), None)
        if conflict is not None:
            raise _PhaseFailed(conflict["message"], conflict) from exc
        bad = [f"rank {r}: {p}" for r, (p, _) in enumerate(gathered) if p]
        if bad:
            raise _PhaseFailed(f"{what} failed: " + "; ".join(bad)) from exc

    @staticmethod
    def _together(what: str, collective: Callable[[Any], Any], obj: Any) -> Any:
        """One collective of a save. Its failure (a peer crashed, was killed, or is stuck
        past the timeout) fails the save like any phase, reported once, no traceback."""
        try:
            return collective(obj)
        except Exception as e:
            raise _PhaseFailed(
                f"{what}: the ranks could not agree, a peer is gone or stuck ({describe(e)})"
            ) from e

    def _save(self, job: SaveJob) -> Manifest:
        step, g = job.step, self.group
        name = step_dir(step)
        t0 = time.monotonic()

        problem, exc, claimed = None, None, True
        try:
            job.staged.wait()
            if g.is_coordinator and step in self.index.committed_steps():
                problem = (
                    f"step {step} is already committed at {self.durable.url_for(name)}"
                    f"{committed_by(self.durable, step)}; a committed checkpoint is never "
                    "overwritten"
                )
            elif g.is_coordinator and (newer := self.index.newer_format(step)) is not None:
                problem = newer.problem
            elif g.is_coordinator:
                claimed = self._claim_quickly(name, step)
        except Exception as e:
            problem, exc = describe(e), e
        self._agree(problem, f"staging step {step}", exc)
        # The durable tier has no commit of this step, so a local manifest here is stale
        # (a reused staging_dir): un-commit that copy before writing over it.
        for root in self._stores:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name, MANIFEST))
            staging_tier.tidy(root, self.current_step, writing=step)
        staged_bytes = job.staged.stats.get("bytes", 0) - job.staged.stats.get("bytes_in_place", 0)
        root = self._local_root(int(staged_bytes), name)
        job.local_root = root
        # The helper reads the node copy's files in memory: they are whole before it starts.
        in_memory = self.memory is not None and root == self.memory.path
        helper = self.helpers.get() if in_memory else None
        local_dir = os.path.join(root, name)
        t1 = time.monotonic()
        job.seconds["staging"] = t1 - t0
        job.seconds["blocking"] = float(job.staged.stats.get("blocking_seconds", 0.0))

        # sync=False: the durable tier is what must survive. Where the durable store can
        # send a shard from memory before its local file is whole, the shard is laid out
        # only, and written to the staging tier while it uploads (LocalWrites).
        from_memory = self.durable.sends_from_memory and helper is None
        writer = TierWriter(
            local_dir,
            sync=False,
            keep_parts=from_memory,
            defer_shards=from_memory and self.durable.uploads_before_file,
            known_checksums=job.staged.checksums,
            arena=job.staged.arena if in_memory else None,
        )
        try:
            dcp.save(
                job.staged.state_dict,
                storage_writer=writer,
                planner=PinnedSavePlanner(job.pinned),
                process_group=g.pg,
                no_dist=g.pg is None,
            )
        except CheckpointException as e:
            raise _PhaseFailed(
                f"writing step {step} to the local staging tier {local_dir} failed: {describe(e)}"
            ) from e
        finally:
            if not writer.parts:
                job.staged.release()  # the host buffers are free for the next save
        t2 = time.monotonic()
        job.seconds["local"] = t2 - t1
        job.checksummed_in_copy_bytes = writer.reused_checksum_bytes
        job.in_place_bytes = writer.in_place_bytes
        self._layout = writer.layout if in_memory else None
        if job.staged.released:  # the first arena, made here, not in the loop; a spare
            self._prepare_arenas(spare=False)  # waits for the commit to tidy the older step

        problem, exc, records, etags = None, None, [], {}
        # The deferred local writes read the buffers too: each holds a loan of its own.
        lent = lend_until_read(
            {**writer.parts, **{LOCAL_LOAN + n: writer.parts[n] for n in writer.deferred}},
            job.staged.release,
        )
        local = LocalWrites(
            writer.deferred, {n: lent.pop(LOCAL_LOAN + n) for n in writer.deferred}, self.config
        )
        memory = lent
        writer.parts = {}
        try:
            records = [*writer.records, self._write_rng(local_dir, job.rng)]
            job.records = records
            if not claimed:  # the durable tier was down at staging: claim now, retrying
                for loan in memory.values():
                    loan.give_back()  # not held through retries: the next save needs them
                claim_step(self.durable, name, step, seen_before=self.index.claimed_before(step))
            etags = None
            if helper is not None:
                etags = self.helpers.upload(helper, local_dir, name, records)
            if etags is None:  # no helper, or it proved unusable: this process's threads
                etags = self._upload(local_dir, name, records, memory, local)
        except Exception as e:
            problem, exc = f"uploading to {self.durable.url_for(name)}: {describe(e)}", e
        finally:
            for copy in memory.values():
                copy.give_back()  # unsent (a failure before its upload): free the buffers
            local_failure = local.join()
        if local_failure is not None and problem is None:
            problem = (
                f"writing step {step} to the local staging tier {local_dir} failed: "
                f"{describe(local_failure)}"
            )
            exc = local_failure
        job.direct_bytes = writer.direct_bytes
        if root == self.staging_dir:
            self._note_page_cache_writes(writer)
        job.memory_bytes = sum(c.size for c in memory.values() if c.sent_from_memory)
        gathered = self._together(
            f"uploading step {step}",
            g.all_gather,
            (records, problem, etags, job.values, generator_digests(job.rng), conflict_fields(exc)),
        )
        t3 = time.monotonic()
        job.seconds["upload"] = t3 - t2

        outcome: tuple[str, Any] | None = None
        if g.is_coordinator:
            outcome = commit_step(
                self.durable, self.index, step, g.world_size, job.values, gathered
            )
        outcome = self._together(f"committing step {step}", g.broadcast, outcome)
        job.seconds["commit"] = time.monotonic() - t3
        if outcome[0] == "conflict":
            raise _PhaseFailed(outcome[1]["message"], outcome[1]) from exc
        if outcome[0] != "ok":
            raise _PhaseFailed(outcome[1]) from exc
        manifest = Manifest.from_json(outcome[1], where=self.durable.url_for(name))
        try:  # the local copy counts as whole once its manifest copy is there
            self._stores[root].write_bytes(f"{name}/{MANIFEST}", outcome[1])
        except Exception as e:
            log.warning(
                "step %d: could not copy the manifest to the staging tier: %s", step, describe(e)
            )
        return manifest

    def _claim_quickly(self, name: str, step: int) -> bool:
        """Claim the step before any rank uploads (format/writers.py), in at most two
        attempts: a durable tier that is down must not hold up the local write (the
        staging buffers are needed by the next save). False: claim at the upload."""
        quick = copy.copy(self.durable)
        quick.retry = _CLAIM_RETRY
        try:
            claim_step(quick, name, step, seen_before=self.index.claimed_before(step))
        except StoreError as e:
            if not e.transient and not isinstance(e, RetriesExhaustedError):
                raise
            return False
        return True

    def _note_page_cache_writes(self, writer: TierWriter) -> None:
        """Say once when a shard went through the page cache (no O_DIRECT there)."""
        if self._told_page_cache or not writer.page_cache_used:
            return
        self._told_page_cache = True
        log.info(
            "the staging tier %s refuses O_DIRECT writes: checkpoint shards go through the "
            "page cache there, which costs CPU time and memory per byte saved",
            self.staging_dir,
        )

    def _local_root(self, nbytes: int, name: str) -> str:
        """Where this save's local copy (step directory ``name``) goes: the memory tier
        while it has room for ``nbytes`` more, else the disk staging tier. Never raises:
        every rank goes on to the same collectives (a disk that refuses fails the local
        write, on every rank alike)."""
        memory = self.memory
        tight = memory is not None and memory.active and not memory.room_now(nbytes)
        if tight and memory is not None:  # other nodes' replicas go first, then idle arenas
            freed = drop_replicas(memory.path)
            if freed:
                log.warning(
                    "memory tier %s: dropped %s of other nodes' replicas to make room for "
                    "step %s", memory.path, format_size(freed), name,
                )  # fmt: skip
            tight = not memory.room_now(nbytes)
        if tight and self.arenas is not None:  # an idle arena's pages make room for this copy
            self.arenas.drop_free()
        if memory is not None and memory.active and memory.has_room(nbytes):
            try:
                os.makedirs(os.path.join(memory.path, name), exist_ok=True)
                return memory.path
            except OSError as e:
                memory.active = False
                log.warning("memory tier %s is off: %s", memory.path, describe(e))
        with contextlib.suppress(OSError):
            os.makedirs(os.path.join(self.staging_dir, name), exist_ok=True)
        return self.staging_dir

    def _write_rng(self, local_dir: str, rng: dict[str, Any]) -> FileRecord:
        name = rng_file(self.group.global_rank)
        data = json.dumps(rng, sort_keys=True).encode()
        store = self._stores[os.path.dirname(local_dir)]
        store.write_bytes(f"{os.path.basename(local_dir)}/{name}", data)
        return FileRecord(name=name, size=len(data), crc32c=crc32c_bytes(data))

    def _upload(
        self,
        local_dir: str,
        name: str,
        records: list[FileRecord],
        memory: dict[str, FileInMemory],
        local: LocalWrites,
    ) -> dict[str, str | None]:
        """Upload every file; returns each one's etag as it stood right after the upload
        (the commit checks that no other writer's upload replaced it since)."""
        etags: dict[str, str | None] = {}

        def one(rec: FileRecord) -> None:
            key = f"{name}/{rec.name}"
            self.durable.upload(
                os.path.join(local_dir, rec.name),
                key,
                memory=memory.get(rec.name),
                local_ready=local.ready(rec.name),
            )
            etags[rec.name] = self.durable.info(key).etag

        streams = max(1, min(self.config.upload_streams, len(records)))
        with ThreadPoolExecutor(
            streams, thread_name_prefix="unbroken-upload", initializer=name_native_thread
        ) as pool:
            for f in [pool.submit(one, r) for r in records]:
                f.result()
        return etags

    def _replicate(self, job: SaveJob) -> None:
        """A commit whose node copy is in the memory tier goes on to the replica nodes
        (in the replicator's thread: the next save never waits for it)."""
        if self.replicator is None or self.memory is None or job.manifest is None:
            return
        if job.local_root != self.memory.path or not job.records:
            return
        self.replicator.submit(
            Replica(
                step=job.step,
                folder=os.path.join(job.local_root, step_dir(job.step)),
                files={rec.name: rec.crc32c for rec in job.records},
                manifest=job.manifest.to_json(),
            )
        )

    def _after_commit(self, manifest: Manifest) -> None:
        """Retention on both tiers (best effort; a failure here never fails the save)."""
        self.current_step = manifest.step
        for root in self._stores:  # one local copy: the step's own tier keeps it
            staging_tier.tidy(root, self.current_step)
        if self.group.is_coordinator:
            try:
                prune_durable(
                    self.durable,
                    self.index,
                    keep_last=self.config.keep_last,
                    keep_every_steps=self.config.keep_every_steps,
                )
            except Exception as e:
                log.warning(
                    "retention on %s failed (nothing committed was lost): %s",
                    self.durable.url,
                    describe(e),
                )
        try:  # every rank's wait() returns once the coordinator's retention is done
            self.group.all_gather(None)
        except Exception as e:
            log.warning(
                "step %d: waiting for retention on every rank failed: %s",
                manifest.step,
                describe(e),
            )
