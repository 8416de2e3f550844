"""CheckpointManager: the training loop's one entry point to checkpoints.

The foreground part of a save is only: build the flat state dict, start staging it into
reused host buffers (module buffers first), capture the RNG states, hand the job to the
background pipeline. Everything else (local tier, durable tier, commit, retention) runs in
:mod:`unbroken.checkpoint.pipeline`; restore lives in :mod:`unbroken.checkpoint.recovery`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

from unbroken._util.collectives import Group, release
from unbroken._util.world import require_group
from unbroken.checkpoint import json_values, open_managers
from unbroken.checkpoint.catalog import CheckpointInfo, list_checkpoints
from unbroken.checkpoint.config import (
    CheckpointConfig,
    SaveStats,
    check_option_names,
    check_seconds,
    default_staging_dir,
)
from unbroken.checkpoint.elastic_env import warn_if_restarts_may_hang
from unbroken.checkpoint.errors import OlderStepRestoredError, SaveFailedError, SaveRefusedError
from unbroken.checkpoint.format.manifest import check_step
from unbroken.checkpoint.format.values import check_items
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.peers.network import PeerNetwork, replica_stores
from unbroken.checkpoint.peers.replicator import Replicator
from unbroken.checkpoint.pipeline import REPLICA_CLOSE_SECONDS, PipelineConfig, SavePipeline
from unbroken.checkpoint.preemption import EXIT_CODE, PreemptionWatch, not_the_loops_time
from unbroken.checkpoint.save_cadence import SaveCadence
from unbroken.checkpoint.save_job import SaveJob
from unbroken.checkpoint.staging.stager import StateStager
from unbroken.checkpoint.staging_tier import check_local_durable, check_staging_dir
from unbroken.checkpoint.state_dicts import FlatState, collect, state_bytes
from unbroken.goodput import autopilot
from unbroken.goodput import recorder as goodput_recorder
from unbroken.state.rng import capture_rng_state
from unbroken.storage import LocalStore, Store, open_store
from unbroken.storage.errors import redact

log = logging.getLogger(__name__)

REPLICA_WAIT_SECONDS = 10.0
"""How long wait() gives the newest commit's replica to land on the next node."""
PEER_DRAIN_SECONDS = 5.0
"""How long a node that ends without a clean close keeps its server for the replicas
its peers are still sending (a preemption's last commit)."""

__all__ = ["CheckpointConfig", "CheckpointInfo", "CheckpointManager", "SaveStats"]


class CheckpointManager:
    """Asynchronous, tiered, atomically committed checkpoints with automatic recovery.

    On several ranks, construct it on every rank in the same order (it makes its own
    gloo groups, a collective call), and call save/maybe_save/restore on every rank.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        staging_dir: str | os.PathLike | None = None,
        every_steps: int | None = 500,
        every_seconds: float | Literal["auto"] | None = None,
        keep_last: int | None = 3,
        keep_every_steps: int | None = None,
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if every_seconds == "auto" and every_steps == 500:
            every_steps = None  # "auto" sets the cadence, unless given steps on purpose
        check_option_names(options)
        config = CheckpointConfig(
            url=os.fspath(url),
            staging_dir=os.fspath(staging_dir) if staging_dir is not None else None,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every_steps=keep_every_steps,
            async_save=async_save,
            storage_options=storage_options,
            **options,
        )
        self.config = config
        warn_if_restarts_may_hang(os.environ)
        require_group("CheckpointManager")
        self.store: Store = open_store(
            config.url, retry=config.retry, **(config.storage_options or {})
        )
        self.staging_dir = os.path.abspath(config.staging_dir or default_staging_dir(config.url))
        check_local_durable(self.store)
        check_staging_dir(self.staging_dir, self.store)
        open_managers.close_older_on(self.staging_dir, self.store.url)  # a cell run again
        self.staging = LocalStore(self.staging_dir)
        self.stats = SaveStats()
        # Two groups: the worker's, and one for foreground agreement (due / busy), so the
        # two threads never share a group and neither touches the default group.
        self._group = Group.create(config.timeout)
        self._fg_group = Group.create(config.timeout)
        self._goodput = goodput_recorder.start(
            self.store,
            self.staging_dir,
            self._fg_group,
            enabled=config.goodput,
            owner=self,
            mlflow=config.mlflow,
        )
        self._cadence = SaveCadence(
            config,
            autopilot.start(self.store, self._fg_group, self._goodput, config.mtbf)
            if config.every_seconds == "auto"
            else None,
            self._goodput,
        )
        self._stager = StateStager(
            max_bytes=config.staging_max_bytes, shared_memory=config.staging_shared_memory
        )
        self._preemption = (
            PreemptionWatch(Group.create(config.timeout), on_give_up=self._goodput.abandon)
            if config.preemption != "off"
            else None
        )
        self.preempted = False
        """True once a preemption signal's save has committed (see ``preemption``)."""
        self._failures: list[SaveFailedError] = []
        self.failures: list[SaveFailedError] = []
        """Every background save failure so far (reported or not)."""
        self._lock = threading.Lock()
        self._closed = False
        self.last_restore: Any = None
        """What the last restore() loaded (step, tier, url, seconds), or None."""
        self._last_error: SaveFailedError | None = None
        """The newest save's failure; None once a later save committed."""
        self._checked: dict[str, type] = {}  # the state's values found loadable
        self._warned: SaveFailedError | None = None
        """The newest failure reported by a warning alone (not raised)."""
        self.memory_tier = (
            MemoryTier.open(
                self.staging_dir,
                self.store.url,
                self._group.global_rank,
                required=bool(config.memory_tier),
            )
            if config.memory_tier is not False
            else None
        )
        """The node's memory tier (None: off, or no tmpfs for it)."""
        self._peers = PeerNetwork.start(
            self._group, self.staging_dir, self.memory_tier, config.replicas
        )
        """The job's peer servers (None: one node, or replicas=0)."""
        clients = self._peers.replica_clients() if self._peers is not None else []
        replicator = (
            Replicator(self._group.global_rank, clients, on_done=self.stats.count_replica)
            if clients
            else None
        )
        self._pipeline = SavePipeline(
            self.store,
            self.staging_dir,
            self._group,
            PipelineConfig(
                keep_last=config.keep_last,
                keep_every_steps=config.keep_every_steps,
                upload_streams=config.upload_streams,
                save_helper=config.save_helper,
            ),
            on_done=self._on_done,
            memory=self.memory_tier,
            replicator=replicator,
            on_arena=self._stager.forget,
        )
        open_managers.track(self)  # a script that never calls close() keeps its last saves

    def _size_memory_tier(self, flat: FlatState, *, saving: bool = True) -> None:
        tier = self.memory_tier
        if tier is not None and tier.active:
            tier.check_fits(state_bytes(flat), required=bool(self.config.memory_tier))
        if saving and tier is not None and not tier.active and self._peers is not None:
            self._peers.stop_serving(tier)  # not at a restore: peers may be reading it

    # -- saving ----------------------------------------------------------------------

    @not_the_loops_time
    def maybe_save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Save if ``step`` is due (every_steps / every_seconds); True if a save started."""
        check_step(step)
        if self._ended_by_preemption(step):
            return False
        self._refuse_if_closed()
        self._cadence.refuse_going_back(step, redact(self.store.url))  # at once, not when due
        self._goodput.step(step)
        self._cadence.time_step(lambda: self._pipeline.in_flight is not None)
        self._report_failures(raising=False)
        if self._preemption is not None and self._preemption.poll():
            return self._save_before_preemption(step, state)
        due = self._cadence.is_due(step)
        busy = self._stager.busy  # a snapshot still waits for its local write or upload
        if self._fg_group.world_size > 1 and (
            self.config.every_seconds is not None or (due and self.config.when_busy == "skip")
        ):
            due, busy = self._fg_group.any(due, busy)
        if not due:
            return False
        skip = busy and self.config.when_busy == "skip" and not self._cadence.is_milestone(step)
        return self._save(step, state, skip_if_busy=skip)

    def _save_before_preemption(self, step: int, state: Mapping[str, Any]) -> bool:
        """Every rank, at the same call: save ``step`` (after the save in flight), wait for
        the commit, then end the process or set ``preempted``."""
        log.warning("preempted: saving step %d and waiting for its commit", step)
        assert self._preemption is not None
        self._preemption.tried = step
        with self._preemption.still_waiting(step):  # (async_save=False: commits in _save)
            saved = self._save(step, state, skip_if_busy=False)
            self.wait()  # raises if the save failed: the process must not end quietly then
        self.preempted = True  # (wait gave the step's replica REPLICA_WAIT_SECONDS at most)
        self._preemption.saved(ending=self.config.preemption == "exit")  # one save
        if self.config.preemption == "exit":
            self._close(clean=False, replica_seconds=0.0)  # the memory tier stays
            if open_managers.yet_to_save_for_preemption(self, step):  # an EMA's manager
                return saved  # the last of them ends the process
            log.warning("preempted: step %d is committed; ending the process", step)
            if threading.current_thread() is not threading.main_thread():
                self._preemption.end_main_thread()  # SystemExit ends only this thread
            raise SystemExit(EXIT_CODE)
        return saved

    @not_the_loops_time
    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Save now (waits for a save still in flight); False if ``step`` is already committed,
        or, with ``async_save=False``, if the save failed (its failure is warned about;
        a refused save, SaveRefusedError (another job saving to this URL, say), is raised)."""
        check_step(step)
        if self._ended_by_preemption(step):
            return False
        self._report_failures(raising=False)
        return self._save(step, state, skip_if_busy=False)

    def _ended_by_preemption(self, step: int | None) -> bool:
        """Whether the preemption's save closed the manager (``preemption="exit"``): the
        process is on its way out, and a save or wait in the user's ``finally`` must not
        raise (exit 1 for a scheduler, where 143 says preempted). A step not committed is
        said, not saved."""
        if not (self._closed and self.preempted):
            return False
        if step is not None and not self._cadence.has(step):
            log.warning("preempted: step %d not saved: the process is ending after the "
                        "preemption's save of step %s", step, self._cadence.last_step)  # fmt: skip
        return True

    def _refuse_if_closed(self) -> None:
        if self._closed:  # its groups are released: a collective would fail obscurely
            raise RuntimeError(
                f"CheckpointManager of {redact(self.store.url)} is closed (close(), its with "
                "block's end, or a newer manager on its staging dir); make a new one"
            )

    def _save(self, step: int, state: Mapping[str, Any], *, skip_if_busy: bool) -> bool:
        self._refuse_if_closed()
        self._cadence.refuse_going_back(step, redact(self.store.url))
        self._group.refuse_if_alone("CheckpointManager")
        t0 = time.monotonic()
        self.stats.requested += 1
        if self._cadence.has(step):
            self.stats.skipped_committed += 1
            return False
        if skip_if_busy:  # agreed by every rank, whatever this rank's own worker is doing
            self.stats.skipped_busy += 1
            log.info("checkpoint step %d skipped: the previous save is still in flight", step)
            return False
        flat = collect(state)
        check_items(flat.tensors, self._checked)  # at once: every save would fail
        self._size_memory_tier(flat)
        self._goodput.save_begin(step)
        busy, began = self._stager.busy, time.monotonic()
        # stage() first waits for the previous snapshot's local write, if still running.
        staged = self._stager.stage(flat.tensors, first=flat.first, arena=self._pipeline.arena)
        if busy:
            self.stats.waited_busy += 1
            self.stats.seconds_waited_busy += time.monotonic() - began
        started = False
        try:
            values, rng = json_values.encode(flat.values), capture_rng_state(flat.generators)
            job = SaveJob(step=step, staged=staged, values=values, rng=rng,
                          pinned=frozenset(flat.first))  # fmt: skip
            self._cadence.started(step)
            started = True
            self._pipeline.submit(job)
        except BaseException:  # Ctrl-C included: no job will hand the buffers back
            if started:
                self._cadence.finished(step, ok=False, seconds=None)
            staged.release()
            raise
        self.stats.started += 1
        if not self.config.async_save:
            job.done.wait()
            self._report_failures(raising=self.config.raise_on_failure)
        self.stats.seconds_blocked += time.monotonic() - t0
        self._cadence.blocked(time.monotonic() - t0)
        self._goodput.save_end(step)
        return self.config.async_save or job.error is None

    def _on_done(self, job: SaveJob) -> None:
        """Worker thread: account for a finished job."""
        with self._lock:
            self.stats.count_done(job)
            self._goodput.commit(
                job.step,
                ok=job.error is None,
                seconds=job.seconds.get("total"),
                nbytes=job.manifest.nbytes if job.manifest is not None else 0,
                upload_seconds=job.seconds.get("upload"),
            )
            self._cadence.finished(job.step, ok=job.error is None, seconds=job.seconds.get("total"))
            self._last_error = job.error
            if job.error is not None:
                self._failures.append(job.error)
                self.failures.append(job.error)
                log.error("%s", job.error)

    def _report_failures(self, *, raising: bool) -> None:
        """Each failure is reported once: raised, or warned about (then kept in .failures).
        A refused save (SaveRefusedError: another job saving to this URL, a step behind
        the URL's newest, ranks at different steps) is always raised: it never heals, and a
        job warned about it would train on for days with every save failing."""
        with self._lock:
            pending, self._failures = self._failures, []
        if not pending:
            return
        conflicts = [err for err in pending if isinstance(err, SaveRefusedError)]
        if raising or self.config.raise_on_failure or conflicts:
            self._warned = None
            raised = conflicts[-1] if conflicts else pending[-1]
            for err in pending:
                if err is not raised:
                    log.error("also failed: %s", err)
            raise raised
        for err in pending:
            warnings.warn(str(err), RuntimeWarning, stacklevel=3)
        self._warned = pending[-1]

    # -- waiting and closing -----------------------------------------------------------

    @not_the_loops_time
    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight is committed; raise SaveFailedError if one failed.
        On several nodes, then give its replica (``replicas``) up to REPLICA_WAIT_SECONDS
        to land on the next node (best effort: a replica never fails a save).

        ``timeout``: seconds, after which TimeoutError (0 polls); None waits as long as it takes.
        """
        if timeout is not None:
            check_seconds("CheckpointManager.wait: timeout", timeout, zero=True)
        if self._ended_by_preemption(None):
            return
        t0 = time.monotonic()
        self._goodput.save_begin(None, wait=True)
        self._pipeline.wait(timeout)
        left = REPLICA_WAIT_SECONDS
        if timeout is not None:
            left = min(left, max(0.0, timeout - (time.monotonic() - t0)))
        self._pipeline.wait_replicated(left)  # best effort: a replica never fails a save
        self._goodput.save_end(None, wait=True)
        self.stats.seconds_in_wait += time.monotonic() - t0
        self._report_failures(raising=True)

    def close(self) -> None:
        """Wait for the save in flight, stop the worker; raises if the last save failed (an
        earlier failure not yet reported is warned about once a later save committed). A clean
        end: the memory tier's files go (a job that crashes or is preempted keeps them for
        its restart on this node)."""
        self._close(clean=True)

    @not_the_loops_time
    def _close(
        self, *, clean: bool, replica_seconds: float = REPLICA_CLOSE_SECONDS, failed: bool = False
    ) -> None:
        """``clean``: the job ended (its memory tier and replicas go, nothing waits for
        them); else the last commit's replica gets ``replica_seconds`` to leave, and this
        node's server lets its peers' last replicas land first (PEER_DRAIN_SECONDS)."""
        if self._closed:
            return
        ended = False  # END only once close() returns: one that raises is a crash
        try:
            try:
                self._goodput.save_begin(None, wait=True)
                self._pipeline.wait()
            finally:
                self._goodput.save_end(None, wait=True)
                self._closed = True
                self._pipeline.close(replica_seconds=0.0 if clean else replica_seconds)
                if self._peers is not None:
                    self._peers.close(drain_seconds=0.0 if clean else PEER_DRAIN_SECONDS)
                self._stager.close()
            # After the worker stopped: a failure recorded while close() waited is reported
            # too; raised unless a later save committed (the run ends with its progress kept).
            self._report_failures(raising=self._last_error is not None)
            if clean and self.memory_tier is not None:
                self.memory_tier.remove_own()
            last = self._last_error
            if clean and last is not None and last is self._warned:  # the run ends without it
                raise SaveFailedError(
                    last.step, message=f"{last} (warned before; no save committed after it)"
                ) from last
            ended = not failed  # (a failed run has no END either: its rerun is a restart)
        finally:
            if ended:  # before the preemption watch lets a pending signal end the process
                self._goodput.close(preempted=self.preempted)
            else:
                self._goodput.abandon()
            if self._preemption is not None:  # last: a signal no save took up goes on here
                failure, signum = sys.exc_info()[1], self._preemption.unhandled
                if failure is not None and signum is not None:  # it ends the process now
                    log.error("ending by %s with close() failing: %s", signal.Signals(signum).name,
                              failure)  # fmt: skip
                self._preemption.close()
            watch = self._preemption  # the worker's group: the pipeline's close, once joined
            release(self._fg_group, watch.group if watch is not None else None)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, *_: object) -> None:
        failed = exc_type is not None and not (isinstance(exc, SystemExit) and not exc.code)
        self._close(clean=not failed, failed=failed)

    # -- restoring and listing -----------------------------------------------------------

    def restore(
        self, state: MutableMapping[str, Any], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load the newest committed checkpoint (or ``step``) into ``state``; its step or None.

        Modules, optimizers, schedulers and tensors are loaded in place; JSON-able entries
        are replaced in ``state``; each rank's RNG states are restored.
        """
        from unbroken.checkpoint.recovery import restore

        if step is not None:
            check_step(step)
        self._refuse_if_closed()
        self._group.refuse_if_alone("CheckpointManager")
        self._pipeline.drain()
        self._report_failures(raising=False)
        self._cadence.left_newer = None  # a restore of the newest step lifts it
        self._size_memory_tier(collect(state), saving=False)
        self._goodput.restore_begin()
        memory = self._pipeline.node.memory_store()
        peers = self._peers.peer_stores(self.store) if self._peers is not None else []
        try:
            restored = restore(
                state,
                durable=self.store,
                staging=self.staging,
                group=self._group,
                step=step,
                strict=strict,
                memory=memory,
                replicas=replica_stores(self.memory_tier) if memory is not None else [],
                peers=peers,
            )
        finally:
            for peer in peers:
                peer.client.close()  # the peers' servers hold a thread per connection
        self.last_restore = restored
        if restored is None:
            self._goodput.restore_end(None)
            return None
        self._goodput.restore_end(restored.step, tier=restored.tier)
        self._pipeline.current_step = restored.step  # its local copy is the one to keep
        # newer steps restore went past (unusable) do not hold back this run's saves
        self._pipeline.unusable = set(restored.newer) if step is None else set()
        newer = list(restored.newer) if step is not None else []  # from the agreed listing
        self._cadence.restored(restored.step, newer)
        if newer:
            log.warning("%s", OlderStepRestoredError(redact(self.store.url), restored.step, newer))
        return restored.step

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint in the durable tier, committed or not, by step."""
        return list_checkpoints(self.store)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({redact(self.store.url)!r}, staging_dir={self.staging_dir!r}, "
            f"every_steps={self.config.every_steps}, keep_last={self.config.keep_last})"
        )
