"""A rank's replication: after a commit, its files of the step go to its replica nodes.

One thread per rank, at the lowest priority; the newest committed step waiting replaces
an older one that has not started (a replica is worth only as the newest). It reads the
node's memory tier files (the commit made them whole), never the staging buffers, and
sends them with ``sendfile``: no copy through this process and no turn of its
interpreter per byte. A failure is logged (once per cause) and never fails a save: the
durable tier holds every committed byte.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from unbroken._util.priority import lower_thread_priority
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint.peers.client import PeerClient, PeerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    """One rank's committed files of a step, to be copied."""

    step: int
    folder: str
    """The step directory in the node's memory tier."""
    files: dict[str, int]
    """This rank's files there, each with its crc32c."""
    manifest: bytes
    """The step's commit record, sealed last on the receiving side."""


class Replicator:
    """Sends rank ``rank``'s committed files to each of ``targets`` (peer clients)."""

    def __init__(
        self,
        rank: int,
        targets: list[PeerClient],
        *,
        on_done: Callable[[int, int, bool], None] | None = None,
        lower_priority: bool = True,
    ) -> None:
        self.rank = rank
        self._on_done = on_done
        """Called with (step, bytes sent, whether every replica node holds it) per step."""
        self.targets = targets
        self._lower = lower_priority
        self._cond = threading.Condition()
        self._next: Replica | None = None
        self._busy = False
        self._closed = False
        self._told: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="unbroken-replicate", daemon=True)
        self._thread.start()

    def submit(self, replica: Replica) -> None:
        with self._cond:
            if self._closed:
                return
            self._next = replica  # an older one still waiting is dropped
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing waits or is being sent; False if ``timeout`` came first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._next is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop after what is being sent, given ``timeout`` seconds to finish; the
        connections close (a transfer still going breaks off: that replica is refused)."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._next = None
            self._cond.notify_all()
        for client in self.targets:
            client.close()
        self._thread.join(timeout)

    def _loop(self) -> None:
        name_native_thread()
        if self._lower:
            lower_thread_priority()
        while True:
            with self._cond:
                while self._next is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                replica, self._next, self._busy = self._next, None, True
            try:
                self._send(replica)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, replica: Replica) -> None:
        ok, sent = True, 0
        for client in self.targets:
            if not os.path.isdir(replica.folder):
                log.debug("step %d: superseded before it was sent", replica.step)
                return  # the next commit's tidy took it: the newer replica follows
            try:
                for name, crc in sorted(replica.files.items()):
                    path = os.path.join(replica.folder, name)
                    client.put_file(self.rank, replica.step, name, path, crc)
                    sent += os.path.getsize(path)
                client.seal(self.rank, replica.step, replica.manifest)
            except (ConnectionError, PeerError, OSError) as e:
                if isinstance(e, FileNotFoundError) and not os.path.isdir(replica.folder):
                    log.debug("step %d: superseded while it was sent", replica.step)
                    return  # not a failure: a newer commit's replica replaces it
                if self._closed:  # close() broke it off (a clean end needs no replica)
                    log.debug("step %d: replica broken off by close: %s", replica.step, e)
                    return
                ok = False
                self._tell(client, replica.step, e)
        if self._on_done is not None:
            self._on_done(replica.step, sent, ok)

    def _tell(self, client: PeerClient, step: int, e: BaseException) -> None:
        """Log a failure once per peer and kind (a full peer would say so every save)."""
        message = f"step {step}: rank {self.rank}'s replica to {client.url} failed: {e}"
        kind = f"{client.url}:{type(e).__name__}:{getattr(e, 'no_room', False)}"
        if kind not in self._told:
            self._told.add(kind)
            log.warning("%s (the durable tier holds it; later failures of this kind are "
                        "not logged)", message)  # fmt: skip
