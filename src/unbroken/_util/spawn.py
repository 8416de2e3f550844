"""Start a helper process from a background thread while other threads fork.

``subprocess.Popen`` learns whether ``exec`` worked by reading a close-on-exec pipe
until the child has exec'd. A fork in another thread at that moment (a DataLoader
worker, any multiprocessing child) hands the new child a copy of that pipe's write end
which no ``exec`` ever closes: ``Popen`` then waits until that child exits, which for a
DataLoader worker is the end of the epoch or of the run. The same fork would keep a copy
of the parent's end of a socket meant for the helper alone, and the helper's death
would go unseen. Forks made through ``os.fork`` (multiprocessing's included) therefore
wait while a :func:`forks_wait` block runs.
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


@contextmanager
def forks_wait() -> Iterator[None]:
    """Forks in other threads wait until this block ends. Keep it to starting the
    process and closing the parent's copies of what only the child should hold; a fork
    inside it, in this thread, would wait for itself."""
    with _spawning:
        yield


def start_module(
    module: str, *args: str, handed: Sequence[socket.socket] = (), **popen: Any
) -> subprocess.Popen:
    """Run ``python -m module *args`` with this package importable (a source checkout
    too). ``handed``: sockets the child inherits and the parent's copies of which are
    closed before any other thread may fork."""
    env = dict(popen.pop("env", None) or os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    fds = tuple(s.fileno() for s in handed)
    with forks_wait():
        try:
            return subprocess.Popen(
                [sys.executable, "-m", module, *args], pass_fds=fds, env=env, **popen
            )
        finally:
            for sock in handed:
                sock.close()


def _before_fork() -> None:
    _spawning.acquire()


def _after_fork() -> None:
    _spawning.release()  # in the child too: the forking thread took it, and is the one left


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
    )
