"""Follow a job live in MLflow: rank 0 logs the loop's figures every N steps.

On when ``mlflow`` is installed and a tracking URI is configured (``MLFLOW_TRACKING_URI``)
or a run is active when the manager is made; off with ``CheckpointManager(mlflow=False)``
or ``UNBROKEN_MLFLOW=0``. Everything after the start (creating the run, logging) happens
on the sink's own thread, through ``MlflowClient`` with an explicit run id, so a slow
tracking server never holds the loop. The run id is kept beside the event log
(``_goodput/mlflow-run.json``), so a restarted attempt logs to the same run.

Metrics, each logged at the training step it was read at:

- ``fetch_seconds``: the loop's wait for data per step, over the steps since the last log;
- ``checkpoint_blocked_seconds``: seconds blocked in saves since the last log;
- ``checkpoint_commit_seconds``: the newest commit's save-to-commit time;
- ``checkpoint_upload_mb_per_s``: its bytes over its upload time;
- ``cache_hit_ratio``: the share of the samples read so far that needed no remote fetch
  by this rank (its workers' and its fill-ahead's fetches are the misses);
- ``checkpoint_interval_seconds``: with ``every_seconds="auto"``, the interval chosen;
- ``goodput``: the job's goodput so far (rank 0's timeline, earlier attempts included).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from unbroken._util.job import job_id
from unbroken.goodput import events as ev
from unbroken.goodput import jobs
from unbroken.goodput.breakdown import job_events
from unbroken.goodput.running import RunningGoodput
from unbroken.storage import ObjectNotFoundError, Store

log = logging.getLogger(__name__)

RUN_KEY = f"{ev.PREFIX}/mlflow-run.json"
"""Where the run id is kept, in the durable tier."""
CLOSE_SECONDS = 60.0
"""How long a job's clean end waits for its last batch and FINISHED to reach MLflow (a
slow server answers; a hung one is warned about)."""
ABANDON_SECONDS = 10.0
"""The same wait where the job ends otherwise (preempted, crashed): a preemption's grace
is often 30 s, and the checkpoint comes first."""
METRICS = (
    "fetch_seconds",
    "checkpoint_blocked_seconds",
    "checkpoint_commit_seconds",
    "checkpoint_upload_mb_per_s",
    "cache_hit_ratio",
    "goodput",
    "checkpoint_interval_seconds",
)


def enabled_by_env() -> bool:
    return os.environ.get("UNBROKEN_MLFLOW", "1").strip().lower() not in ("0", "false", "off")


def every_steps() -> int:
    """Steps between two logs: ``UNBROKEN_MLFLOW_EVERY_STEPS``, default 50."""
    return max(1, int(os.environ.get("UNBROKEN_MLFLOW_EVERY_STEPS", "50")))


def wanted() -> tuple[str, str | None] | None:
    """(tracking URI, the active run's id or None) if MLflow should be fed, else None.

    Never imports mlflow here (seconds): a run can only be active if the user's code
    imported it already; with only ``MLFLOW_TRACKING_URI`` set the sink's thread does."""
    if not enabled_by_env():
        return None
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        active = mlflow.active_run()
        if active is not None:
            return mlflow.get_tracking_uri(), active.info.run_id
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or importlib.util.find_spec("mlflow") is None:
        return None
    return uri, None


class MlflowSink:
    """One thread that logs the recorder's running figures to one MLflow run."""

    def __init__(
        self,
        store: Store,
        recorder: Any,
        attempt: str,
        tracking_uri: str,
        active_run: str | None,
        *,
        every: int,
    ) -> None:
        self.store = store
        self.recorder = recorder
        self.attempt = attempt
        self.tracking_uri = tracking_uri
        self.active_run = active_run
        self.every = every
        self.run_id: str | None = None
        self._client: Any = None
        self._running: RunningGoodput | None = None
        self._logged_steps = 0
        self._waited, self._blocked = 0.0, 0.0
        self._last_commit: dict[str, Any] | None = None
        self._goodput_at = float("-inf")
        self._goodput: float | None = None
        self._stop = threading.Event()
        self._clean = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="unbroken-mlflow", daemon=True)
        self._thread.start()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        from unbroken._util.thread_names import name_native_thread

        name_native_thread()
        # here, not in __init__: it waits for the log's flush in flight, which rides out
        # the retries of a store that does not answer (the manager's construction must not)
        self.recorder.log.keep_history()
        try:
            self._open_run()
        except Exception as exc:
            if self.run_id is None:
                log.warning(
                    "goodput: MLflow at %s unusable, not logging: %s", self.tracking_uri, exc
                )
                self._failed = True
                self.recorder.log.drop_history()
                return
            log.warning("goodput: MLflow run %s opened, then %s; logging to it all the same",
                        self.run_id, exc)  # fmt: skip
        try:
            self._running = self._running_goodput_of_log()
        except Exception as exc:
            log.warning("goodput: earlier attempts' events unread, no running goodput in "
                        "MLflow: %s", exc)  # fmt: skip
            self.recorder.log.drop_history()
        while not self._stop.wait(0.5):
            if self.recorder.steps_seen - self._logged_steps >= self.every:
                self._log_safely()
        self._finish()

    def _open_run(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        saved = self._saved_run()
        if self.active_run is not None:
            self.run_id = self.active_run
        elif saved is not None:
            self.run_id = saved
            self._client.update_run(saved, status="RUNNING")
        else:
            experiment = _experiment_id(self._client)
            self.run_id = (
                self._orphan_run(experiment)
                or self._client.create_run(
                    experiment, run_name=_run_name(self.store.url), tags=self._job_tags()
                ).info.run_id
            )
        if self.run_id != saved:
            doc = {"run_id": self.run_id, "tracking_uri": self.tracking_uri, "job": job_id()}
            self.store.write_bytes(RUN_KEY, json.dumps(doc).encode())
        self._client.set_tag(self.run_id, "unbroken.attempt", self.attempt)

    def _running_goodput_of_log(self) -> RunningGoodput:
        """Earlier attempts' events, read once: the running goodput spans the whole job
        (this job's: another job writing the same root is not ours)."""
        log_so_far = jobs.of_attempt(ev.read_log(self.store), self.attempt)
        earlier = {  # as the CLI's job figure tells them (a killed rank 0 lost steps)
            a: job_events(ranks) for a, ranks in log_so_far.items() if a != self.attempt and ranks
        }
        running = RunningGoodput(self.attempt, earlier)
        self.recorder.log.merge_history_steps_above(running.earlier_newest_step)
        return running

    def _job_tags(self) -> dict[str, str]:
        from unbroken.storage.errors import redact

        return {"unbroken.job": job_id() or "", "unbroken.root": redact(self.store.url)}

    def _orphan_run(self, experiment: str) -> str | None:
        """The run an earlier attempt of this job created but never recorded (killed while
        create_run waited for its answer), found by its tags: the job keeps one run."""
        tags = self._job_tags()
        if not tags["unbroken.job"] or any("'" in v for v in tags.values()):
            return None  # no job to tell apart, or a value the filter cannot quote
        try:
            found = self._client.search_runs(
                [experiment],
                filter_string=" and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()),
                max_results=1,
                order_by=["attributes.start_time DESC"],
            )
        except Exception:
            return None
        return found[0].info.run_id if found else None

    def _saved_run(self) -> str | None:
        try:
            doc = json.loads(self.store.read_bytes(RUN_KEY))
        except ObjectNotFoundError:
            return None
        except ValueError:
            return None
        if doc.get("tracking_uri") != self.tracking_uri:
            return None  # another server: a run id there means nothing here
        if doc.get("job") != job_id():  # another job on this root (a new launch): its own run
            return None
        run_id = doc.get("run_id")
        try:
            self._client.get_run(run_id)
        except Exception:
            return None
        return run_id

    def _log_safely(self) -> None:
        try:
            self.log_now()
        except Exception as exc:
            if not self._failed:
                log.warning("goodput: MLflow logging failed (will retry): %s", exc)
            self._failed = True

    def log_now(self) -> None:
        """Log one batch of metrics at the recorder's current step."""
        from mlflow.entities import Metric

        rec = self.recorder
        steps, step = rec.steps_seen, rec.last_step
        if step is None or self.run_id is None:
            return
        window = steps - self._logged_steps
        blocked = rec.blocked_total - self._blocked
        values: dict[str, float] = {}
        if window > 0:  # a batch with no new step (the closing one) has no wait to average
            values["fetch_seconds"] = (rec.waited_total - self._waited) / window
        if window > 0 or blocked > 0:
            values["checkpoint_blocked_seconds"] = blocked
        commit = rec.last_commit
        if commit is not None:
            if commit.get("seconds") is not None:
                values["checkpoint_commit_seconds"] = float(commit["seconds"])
            up = commit.get("upload_seconds")
            if up:
                values["checkpoint_upload_mb_per_s"] = commit["nbytes"] / 1e6 / up
        metrics = rec.loader_metrics
        if metrics is not None:
            counters = metrics.counters
            reads = counters.get("samples", 0) + counters.get("skipped", 0)
            if reads:  # misses: remote fetches by any process of this rank (fill included)
                values["cache_hit_ratio"] = max(0.0, 1.0 - counters.get("misses", 0) / reads)
        goodput = self._running_goodput()
        if goodput is not None:
            values["goodput"] = goodput
        interval = getattr(rec, "checkpoint_interval_seconds", None)
        if interval is not None:  # every_seconds="auto" chose it
            values["checkpoint_interval_seconds"] = float(interval)
        now_ms = int(time.time() * 1000)
        batch = [Metric(k, float(v), now_ms, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=batch)
        self._logged_steps = steps
        self._waited, self._blocked = rec.waited_total, rec.blocked_total
        self._failed = False

    def _running_goodput(self) -> float | None:
        """Recomputed at most every 10 s (or 10x its own cost)."""
        now = time.monotonic()
        if self._running is None:
            return None
        if now - self._goodput_at < 10.0 and self._goodput is not None:
            return self._goodput
        mine = self.recorder.log.events_so_far()
        if not any(e.kind == ev.END for e in mine):  # after the END, time is not the job's
            mine.append(ev.Event(ev.BEAT, self.recorder.now()))
        self._goodput = self._running.goodput(mine, self.recorder.last_step)
        cost = time.monotonic() - now
        self._goodput_at = now + 9 * cost
        return self._goodput

    def close(self, *, clean: bool, preempted: bool = False) -> None:
        """A last batch; at a clean end, not a preemption's (the job goes on), the run is
        marked finished (unless it is the user's). Both on the sink's thread, waited for
        ``CLOSE_SECONDS`` (``ABANDON_SECONDS`` after a preemption or a crash) at most: a
        server down or hung must not hold the job's end."""
        self._clean = clean and not preempted
        self._stop.set()
        seconds = CLOSE_SECONDS if self._clean else ABANDON_SECONDS
        self._thread.join(timeout=seconds)
        if self._thread.is_alive():
            log.warning(
                "goodput: MLflow at %s did not answer within %.0f s; the job ends without "
                "its last metrics%s", self.tracking_uri, seconds,
                " and its run is not marked finished" if self._clean else "",
            )  # fmt: skip

    def _finish(self) -> None:
        """The sink's thread, at close: the last batch, and a clean end's FINISHED."""
        if self._client is None or self.run_id is None:
            return
        self._goodput_at = float("-inf")
        self._log_safely()
        if self._clean and self.active_run is None:  # ours, not the user's run
            try:
                self._client.set_terminated(self.run_id, "FINISHED")
            except Exception as exc:
                log.warning("goodput: could not end MLflow run %s: %s", self.run_id, exc)


def start(store: Store, recorder: Any, attempt: str, *, enabled: bool) -> MlflowSink | None:
    """A sink for rank 0 when MLflow is wanted, else None."""
    if not enabled:
        return None
    found = wanted()
    if found is None:
        return None
    uri, active = found
    return MlflowSink(store, recorder, attempt, uri, active, every=every_steps())


def _experiment_id(client: Any) -> str:
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)
    return "0"  # MLflow's Default experiment


def _run_name(url: str) -> str:
    from unbroken.storage.errors import redact

    return redact(url).rstrip("/").rsplit("/", 1)[-1] or "unbroken"
