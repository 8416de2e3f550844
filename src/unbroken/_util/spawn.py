"""Start a helper process from a background thread while other threads fork.

``subprocess.Popen`` learns whether ``exec`` worked by reading a close-on-exec pipe
until the child has exec'd. A fork in another thread at that moment (a DataLoader
worker, any multiprocessing child) hands the new child a copy of that pipe's write end
which no ``exec`` ever closes: ``Popen`` then waits until that child exits, which for a
DataLoader worker is the end of the epoch or of the run. The same fork would keep a copy
of the parent's end of a socket meant for the helper alone, and the helper's death
would go unseen. Forks made through ``os.fork`` (multiprocessing's included) therefore
wait while :func:`start_module` starts one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_spawning = threading.Lock()
_this_fork = threading.local()  # whether the forking thread holds _spawning


@contextmanager
def _forks_wait() -> Iterator[None]:
    """Forks in other threads wait until this block ends. Keep it to starting the
    process and closing the parent's copies of what only the child should hold: a fork
    inside it, in this thread, would wait for itself."""
    with _spawning:
        yield


def start_module(
    module: str, *args: str, handed: Sequence[socket.socket] = (), **popen: Any
) -> subprocess.Popen:
    """Run ``python -m module *args`` with this package importable (a source checkout
    too). ``handed``: sockets the child inherits; the parent's copies are closed before
    any other thread may fork, and on every error."""
    try:
        if "preexec_fn" in popen:  # it forks through the at-fork hooks: a self-deadlock
            raise TypeError(
                "start_module: preexec_fn is not supported (it runs the at-fork hooks "
                "while forks are held back); use start_new_session or process_group"
            )
        env = popen.pop("env", None)
        env = dict(os.environ if env is None else env)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        fds = tuple(s.fileno() for s in handed)
        with _forks_wait():
            try:
                return subprocess.Popen(
                    [sys.executable, "-m", module, *args], pass_fds=fds, env=env, **popen
                )
            finally:
                _close(handed)
    finally:
        _close(handed)  # an error before the block (closing twice is harmless)


def _close(sockets: Sequence[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _before_fork() -> None:
    """Wait for a spawn in progress. A signal handler's exception (Ctrl-C) does not end
    the wait, which would fork inside the spawn's window and release a lock another
    thread holds; it is raised once the lock is held, and CPython reports it (a hook's
    exception never reaches the caller of fork())."""
    interrupted = None
    while True:
        try:
            _spawning.acquire()
            break
        except BaseException as exc:  # not acquired: the handler raised during the wait
            interrupted = exc
    _this_fork.holds = True
    if interrupted is not None:
        raise interrupted


def _after_fork() -> None:
    """In the parent, and in the child, where the forking thread is the one left."""
    if getattr(_this_fork, "holds", False):
        _this_fork.holds = False
        _spawning.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
    )
