"""The staging tier's shard files, written beside their upload.

Where the durable store sends a shard from the host buffers before its local file is
whole (``Store.uploads_before_file``), the save lays each shard out only
(``TierWriter(defer_shards=True)``) and this thread writes it to the staging tier while
the same buffers upload: the commit waits for the longer of the two, not their sum.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from unbroken._util.priority import lower_thread_priority
from unbroken._util.thread_names import name_native_thread
from unbroken.storage.in_memory import FileInMemory

if TYPE_CHECKING:
    from unbroken.checkpoint.pipeline import PipelineConfig


LOCAL_LOAN = "local:"
"""Prefix of the loans of the staging buffers that the deferred local writes hold."""


class LocalWrites:
    """The staging tier's shard files, written on a thread of their own while the same
    buffers upload (``TierWriter(defer_shards=True)``): a save's commit then waits for
    the longer of the two, not their sum."""

    def __init__(
        self,
        writes: dict[str, Callable[[], None]],
        loans: dict[str, FileInMemory],
        config: PipelineConfig,
    ) -> None:
        self.writes, self.loans, self.lower = writes, loans, config.lower_priority
        self.done = {n: threading.Event() for n in writes}
        self.failures: dict[str, BaseException] = {}
        self.thread: threading.Thread | None = None
        if writes:
            self.thread = threading.Thread(target=self._run, name="unbroken-local", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        name_native_thread()
        if self.lower:
            lower_thread_priority()
        for name, write in self.writes.items():
            try:
                self.loans[name].take()
                write()
            except BaseException as e:  # reported by join() and by ready(name)
                self.failures[name] = e
            finally:
                self.loans[name].give_back(read_all=True)
                self.done[name].set()

    def ready(self, name: str) -> Callable[[], None] | None:
        """For ``Store.upload``: blocks until file ``name`` is whole (None: it already is)."""
        if name not in self.writes:
            return None

        def wait() -> None:
            self.done[name].wait()
            if name in self.failures:
                raise self.failures[name]

        return wait

    def join(self) -> BaseException | None:
        """Wait for every write (their loans are given back); the first failure, if any."""
        if self.thread is not None:
            self.thread.join()
        for loan in self.loans.values():
            loan.give_back()
        return next(iter(self.failures.values()), None)
