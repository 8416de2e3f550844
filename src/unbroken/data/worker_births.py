"""Forked DataLoader workers that never start are found and replaced, not waited on forever.

On CPython before 3.11.10 (3.10 and older before their 2024 security releases), a child
forked while another thread holds the interpreter's thread-state lock inherits it held
and hangs inside ``os.fork()`` before any Python runs (gh-112275). In a training process
that lock has a busy holder: gloo's threads take it, without the GIL, each time they drop
the last reference to a tensor a collective used, and every background save's
``dcp.save`` runs several such collectives. A DataLoader that forks its workers at that
instant leaves one of them asleep for good; the training loop then waits on it with no
error, and the job makes no progress until the scheduler's time limit.

Each fork-started worker marks itself born in a small shared table before anything else
it runs (torch's ``worker_init_fn`` wrapper, ``MarkBirth``). The loader waits for the marks
of the workers it just forked; a worker that stays unborn, asleep, and using no CPU for
:data:`STILL_SECONDS` is stuck: it is killed and every worker is forked again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unbroken._util.procs import process_activity

STILL_SECONDS = 2.0
"""How long an unborn worker must sleep without using CPU to count as stuck. A worker
starved of CPU on a loaded node is runnable ("R"), not asleep, and is waited for."""
POLL_SECONDS = 0.002


class WorkerBirths:
    """One shared mark per worker: the plan generation it started under."""

    def __init__(self, num_workers: int) -> None:
        self.marks = torch.zeros(max(num_workers, 1), dtype=torch.int64).share_memory_()

    def mark(self, worker: int, generation: int) -> None:
        """In a worker, first thing: it runs Python, so ``fork()`` returned."""
        self.marks[worker] = generation

    def await_births(self, workers: Sequence[Any], generation: int) -> list[Any]:
        """Wait until every worker of ``workers`` (multiprocessing processes, in worker
        order) has marked ``generation``; the ones found stuck instead, or [] once the rest
        have all marked or ended (torch reports a worker that died). Without /proc (not
        Linux) a stuck worker cannot be told from a slow one: nothing is waited for."""
        if not os.path.exists("/proc/self/stat"):
            return []
        still_since: dict[int, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            waiting, stuck = 0, []
            for index, proc in enumerate(workers):
                if int(self.marks[index]) == generation or not proc.is_alive():
                    continue
                waiting += 1
                activity = process_activity(proc.pid)
                if activity is None:  # no /proc here: no way to tell stuck from slow
                    continue
                state, ticks = activity
                seen = still_since.get(proc.pid)
                if state != "S" or seen is None or seen[0] != ticks:
                    still_since[proc.pid] = (ticks, now)
                elif now - seen[1] >= STILL_SECONDS:
                    stuck.append(proc)
            if stuck or not waiting:
                return stuck
            time.sleep(POLL_SECONDS)


class MarkBirth:
    """A DataLoader ``worker_init_fn`` that marks the worker born, then calls the user's
    (picklable, for spawn and forkserver contexts too)."""

    def __init__(
        self, births: WorkerBirths, plan: torch.Tensor, then: Callable[[int], Any] | None
    ) -> None:
        self.births = births
        self.plan = plan
        self.then = then

    def __call__(self, worker_id: int) -> None:
        self.births.mark(worker_id, int(self.plan[0]))
        if self.then is not None:
            self.then(worker_id)
