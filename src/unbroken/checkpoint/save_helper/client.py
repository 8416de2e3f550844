"""The training process's handle on its save helper: start it, ask it, see it die."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
from typing import Any

from unbroken._util.spawn import start_module
from unbroken.checkpoint.save_helper import messages
from unbroken.storage.errors import StoreError

log = logging.getLogger(__name__)

CLOSE_SECONDS = 10.0
"""How long close() waits for the helper to leave before it is killed."""


class SaveHelperDied(StoreError):
    """The helper process ended while a request was in flight: that save fails."""

    transient = False


class SaveHelperUnusable(StoreError):
    """The helper could not start or open the store: the rank uploads on its own threads."""

    transient = False


class SaveHelper:
    """One helper process per rank; a request at a time; a new process after a death."""

    def __init__(self, store_spec: dict[str, Any], *, lower_priority: bool = True) -> None:
        self._hello = {"op": "open", "store": store_spec, "lower_priority": lower_priority}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._greeted = False
        self.started = 0
        """Helper processes started so far (1 + one per death)."""
        self._start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def upload(self, files: list[tuple[str, str]], streams: int) -> dict[str, str | None]:
        """Upload each ``(local path, key)`` from the helper; each key's etag after it."""
        answer = self._ask({"op": "upload", "files": files, "streams": streams}, "uploading")
        return answer["etags"]

    def close(self) -> None:
        """Ask the helper to leave; kill it if it has not within CLOSE_SECONDS."""
        with self._lock:
            proc, sock = self._proc, self._sock
            self._proc = self._sock = None
        if proc is None or sock is None:
            return
        try:
            messages.send(sock, {"op": "close"})
        except (messages.PeerGone, OSError):
            pass
        sock.close()
        try:
            proc.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # -- private ---------------------------------------------------------------------

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = start_module(
                "unbroken.checkpoint.save_helper", str(theirs.fileno()), str(os.getpid()),
                handed=[theirs], stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except OSError:
            ours.close()
            raise
        self._sock, self._greeted = ours, False
        self.started += 1
        try:  # it reads this while we go on; answered first
            messages.send(ours, self._hello)
        except messages.PeerGone:
            pass  # it ended already: the greeting's read says how

    def _ask(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._replace()
            assert self._sock is not None and self._proc is not None
            if not self._greeted:
                self._greet()
            try:
                messages.send(self._sock, request)
                answer = messages.receive(self._sock)
            except messages.PeerGone:
                raise self._died(what) from None
        return self._check(answer, what)

    def _greet(self) -> None:
        """Read the helper's answer to ``open``; SaveHelperUnusable if it has none. A
        helper killed by a signal before it answered (not one that exited) is replaced
        once: the kill says nothing about the next one."""
        for attempt in range(2):
            assert self._sock is not None
            try:
                self._check(messages.receive(self._sock), "opening the store")
            except messages.PeerGone:
                pid, code = self._end()
                if attempt == 0 and code < 0:
                    self._replace()
                    continue
                raise SaveHelperUnusable(
                    f"the save helper process (pid {pid}) ended as it started ({_how(code)})"
                ) from None
            except StoreError as e:
                raise SaveHelperUnusable(str(e)) from None
            self._greeted = True
            return

    def _replace(self) -> None:
        """A new helper for one that died between requests (its death was reported);
        SaveHelperUnusable where no process can be started (the threads take over)."""
        if self._sock is not None:
            self._sock.close()
        try:
            self._start()
        except OSError as e:
            raise SaveHelperUnusable(f"no new save helper process ({e})") from None

    def _died(self, what: str) -> SaveHelperDied:
        pid, code = self._end()
        how = _how(code)
        log.warning(
            "the save helper (pid %d) died while %s (%s); a new one takes the next save",
            pid,
            what,
            how,
        )
        return SaveHelperDied(
            f"the save helper process (pid {pid}) died while {what} ({how}); this save "
            "fails, the next one starts a new helper"
        )

    def _end(self) -> tuple[int, int]:
        """The helper's pid and exit code, once it has ended (killed if it lingers)."""
        assert self._proc is not None
        try:
            code = self._proc.wait(5.0)
        except subprocess.TimeoutExpired:  # its socket broke and it lives on: end it
            self._proc.kill()
            code = self._proc.wait()
        return self._proc.pid, code

    @staticmethod
    def _check(answer: dict[str, Any], what: str) -> dict[str, Any]:
        if answer.get("ok"):
            return answer
        # the helper's store retried already: what comes back is final
        raise StoreError(f"{answer.get('error', 'no reason given')} (in the save helper, {what})")


def _how(code: int) -> str:
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-code}"
