"""The background half of a save: local tier -> durable tier -> commit -> retention.

One worker thread per manager runs one :class:`SaveJob` at a time, at lowered CPU and I/O
priority. Every rank runs the same sequence of collectives on the manager's dedicated
gloo group for every job, whatever happens locally: a rank that failed sends a
description of its error where others send results, so nobody deadlocks and nothing is
committed. The coordinator writes ``manifest.json`` (the commit record) last, only after
every rank has reported its files durable.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from unbroken._util.collectives import Group
from unbroken._util.priority import lower_thread_priority
from unbroken._util.rest_at_exit import rest_at_exit
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint.commit import commit_step, conflict_fields, generator_digests
from unbroken.checkpoint.durable_index import DurableIndex
from unbroken.checkpoint.durable_prune import prune_durable
from unbroken.checkpoint.errors import (
    SaveFailedError,
    SaveRefusedError,
    StepBehindError,
    refusal_from_fields,
)
from unbroken.checkpoint.format.manifest import FileRecord, Manifest, committed_refusal, step_dir
from unbroken.checkpoint.format.planners import PinnedSavePlanner, unlike_copies_in
from unbroken.checkpoint.format.shard_layout import TensorLayout
from unbroken.checkpoint.format.writer import TierWriter
from unbroken.checkpoint.format.writers import claim_step, live_committer
from unbroken.checkpoint.local_writes import LOCAL_LOAN, LocalWrites
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.node_copies import NodeCopies
from unbroken.checkpoint.peers.replicator import Replicator
from unbroken.checkpoint.save_helper.uploads import HelperSlot
from unbroken.checkpoint.save_job import (
    SaveJob,
    describe,
    drop_frame_locals,
    lend_until_read,
)
from unbroken.checkpoint.save_phases import PhaseFailed, agree_to_stage, recorded_outcome, together
from unbroken.checkpoint.staging.arena import Arena
from unbroken.checkpoint.staging.owner import claim_staging_dir
from unbroken.storage import Store
from unbroken.storage.errors import RetriesExhaustedError, StoreError, redact
from unbroken.storage.in_memory import FileInMemory
from unbroken.storage.retry import RetryPolicy

log = logging.getLogger(__name__)

_QUICK_RETRY = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.05)


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
        self.staging_dir = staging_dir
        self.memory = memory
        self._release_staging = claim_staging_dir(
            staging_dir, group.global_rank, f"saving to {redact(durable.url)}"
        )
        try:  # a claim never released would refuse every later manager of this process
            self.node = NodeCopies(
                staging_dir,
                group.global_rank,
                memory,
                stage_in_place=config.stage_in_place,
                on_arena=on_arena,
                replicator=replicator,
            )
            """Where each save's copy on this node goes, and what the node keeps."""
            self.index = DurableIndex(durable)
            """The coordinator's view of the durable tier's committed steps."""
        except BaseException:
            self._release_staging()
            raise
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
        self.unusable: set[int] = set()
        """Committed steps newer than the restored one that restore went past (unusable):
        they do not make this run's saves "behind" (a restart never loads them)."""
        self._idle = threading.Condition(self._lock)
        self.helpers = HelperSlot(self.durable, self.memory, self.config)
        """The process that uploads saves whose node copy is in the memory tier (none:
        the uploads run on threads here), started by the worker thread as it starts."""
        self._exiting = False
        self._thread = threading.Thread(target=self._loop, name="unbroken-ckpt", daemon=True)
        self._thread.start()
        rest_at_exit(self)

    # -- foreground side -------------------------------------------------------------

    def arena(self) -> Arena | None:
        """Where the next snapshot can stage in the memory tier (``NodeCopies.arena``), once
        the previous snapshot is released (``StateStager.stage(arena=...)`` waits so)."""
        return self.node.arena()

    def submit(self, job: SaveJob) -> None:
        """Queue a job; the worker runs jobs one at a time, in order.

        A job may be queued while the previous one still uploads: its staging has finished
        (the stager lends its buffers to one snapshot at a time; the previous job returned
        them after its local write, or once a store sending from memory had read them)."""
        with self._lock:
            self._jobs.append(job)
            self._pending += 1
        try:
            self._queue.put(job)
        except BaseException:  # Ctrl-C: a job listed but never queued would be waited for
            with self._lock:
                self._jobs.remove(job)
                self._pending -= 1
            raise

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
        return self.node.replicator is None or self.node.replicator.wait(timeout)

    def drain(self) -> None:
        """Until every submitted job and its retention are finished."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self, *, replica_seconds: float = REPLICA_CLOSE_SECONDS) -> None:
        """Finish every job and its retention, stop the worker, release its group.
        ``replica_seconds``: how long the last commit's replica may go on (clean end: none)."""
        try:
            self._queue.put(None)
            self._thread.join()  # a Ctrl-C in it skips the release: it may be in a collective
            self.group.release()
            self.node.close(replica_seconds=replica_seconds)
            self.helpers.close()
        finally:  # a claim never released would refuse this process's next manager
            self._release_staging()

    def rest_before_exit(self, deadline: float) -> None:
        """The interpreter ends with this pipeline open (an exception out of the loop):
        the job under way ends (abandoned, as a rule), no queued one starts
        (``rest_at_exit``)."""
        if self._thread.is_alive():
            self._exiting = True
            self._queue.put(None)
            self._thread.join(max(0.0, deadline - time.monotonic()))

    # -- worker side -----------------------------------------------------------------

    def _loop(self) -> None:
        name_native_thread()
        if self.config.lower_priority:
            lower_thread_priority()
        self.helpers.get()  # starts while the job restores and trains its first steps
        while True:
            job = self._queue.get()
            if job is None or self._exiting:
                return
            try:
                job.manifest = self._save(job)
            except PhaseFailed as e:
                message = f"checkpoint save of step {job.step} failed: {e.args[0]}"
                if self._exiting:  # its cause is the interpreter's end, not the store
                    message = (
                        f"checkpoint save of step {job.step} abandoned: the process ended "
                        "while it was under way, before its commit"
                    )
                if e.conflict is not None:  # never heals: the manager raises it
                    job.error = refusal_from_fields(e.conflict, message)
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
                self.node.failed(job.step)
            job.seconds["total"] = time.monotonic() - job.submitted
            try:
                self._on_done(job)  # before the job leaves _jobs: wait() then sees its error
                if job.manifest is not None:  # housekeeping, before the next job starts
                    self._after_commit(job.manifest)
                    self.node.replicate(job)
                self.node.prepare_arenas()  # the tidy may have freed an older step's
            finally:
                with self._lock:
                    self._jobs.remove(job)
                job.done.set()  # after retention: wait() leaves what a reader will find
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _ahead_of(self, step: int) -> int | None:
        """The newest committed step a restart would load, if it is ``step`` or newer: a
        step this run never restored (its own saves of one are skipped before here)."""
        return self.index.newest_after(step - 1, self.unusable)

    def _save(self, job: SaveJob) -> Manifest:
        step, g = job.step, self.group
        name = step_dir(step)
        t0 = time.monotonic()

        problem, exc, claimed = None, None, True
        try:
            job.staged.wait()
            if g.is_coordinator and (newer := self.index.newer_format(step)) is not None:
                problem = newer.problem
            # a run without restore meets the old run's steps: at this one, or after it
            elif g.is_coordinator and (ahead := self._ahead_of(step)) is not None:
                exc = live_committer(self.durable, ahead) or StepBehindError.at(
                    step, redact(self.durable.url), ahead
                )
                problem = str(exc)
            elif g.is_coordinator and step in self.index.committed_steps():  # an unusable one
                problem = committed_refusal(self.durable, step, passed_over=step in self.unusable)
            elif g.is_coordinator and (damaged := self.index.damaged(step)) is not None:
                problem = (
                    f"step {step} at {self.durable.url_for(name)} holds a damaged checkpoint "
                    f"({damaged.problem}), never overwritten: this step is not saved (delete "
                    "that directory to save it again)"
                )
            elif g.is_coordinator:
                claimed = self._claim_quickly(name, step)
        except Exception as e:
            problem, exc = describe(e), e
        agree_to_stage(self.group, redact(self.durable.url), step, problem, exc)
        self.node.begin(step, self.current_step)
        root = self.node.choose(self.node.bytes_to_write(job.staged.stats), step)
        job.local_root = root
        # The helper reads the node copy's files in memory: they are whole before it starts.
        in_memory = self.node.in_memory(root)
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
                planner=PinnedSavePlanner(job.pinned, job.staged.checksums),
                process_group=g.pg,
                no_dist=g.pg is None,
            )
        except CheckpointException as e:
            if unlike := unlike_copies_in(e):  # the state's fault: every save would fail
                refused = SaveRefusedError(str(unlike), step=step, url=redact(self.durable.url))
                raise PhaseFailed(str(refused), refused.fields()) from unlike
            raise PhaseFailed(
                f"writing step {step} to the local staging tier {local_dir} failed: {describe(e)}"
            ) from e
        finally:
            if not writer.parts:
                job.staged.release()  # the host buffers are free for the next save
        t2 = time.monotonic()
        job.seconds["local"] = t2 - t1
        job.checksummed_in_copy_bytes = writer.reused_checksum_bytes
        job.in_place_bytes = writer.in_place_bytes
        self.node.written(root, writer.layout, job.staged.released)

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
            records = [*writer.records, self.node.write_rng(local_dir, job.rng)]
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
        gathered = together(
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
        try:
            outcome = together(f"committing step {step}", g.broadcast, outcome)
        except PhaseFailed:  # a peer gone: the step stands if its record holds our files
            quick = self.durable.with_retry(_QUICK_RETRY)  # (the job is going down)
            if (outcome := recorded_outcome(quick, step, records, outcome)) is None:
                raise
        job.seconds["commit"] = time.monotonic() - t3
        if outcome[0] == "conflict":
            raise PhaseFailed(outcome[1]["message"], outcome[1]) from exc
        if outcome[0] != "ok":
            raise PhaseFailed(outcome[1]) from exc
        manifest = Manifest.from_json(outcome[1], where=self.durable.url_for(name))
        self.node.committed(root, step, outcome[1])
        return manifest

    def _claim_quickly(self, name: str, step: int) -> bool:
        """Claim the step before any rank uploads (format/writers.py), in at most two
        attempts: a durable tier that is down must not hold up the local write (the
        staging buffers are needed by the next save). False: claim at the upload."""
        quick = self.durable.with_retry(_QUICK_RETRY)
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

    def _after_commit(self, manifest: Manifest) -> None:
        """Retention on both tiers (best effort; a failure here never fails the save)."""
        self.current_step = manifest.step
        self.node.keep_only(self.current_step)
        if self.group.is_coordinator:
            try:
                prune_durable(
                    self.durable,
                    self.index,
                    keep_last=self.config.keep_last,
                    keep_every_steps=self.config.keep_every_steps,
                    passed_over=self.unusable,
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
