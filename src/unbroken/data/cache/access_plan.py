"""Each process's future access order, published for the node's evictors to read.

A process that knows what it will read (a DataLoader worker knows its slice of the
epoch) writes the names in order to ``plans/<pid>-<token>.plan`` and keeps a cursor,
the count of planned reads already done, in ``<pid>-<token>.cursor``. Any process
that must evict loads every live plan and evicts what is needed furthest ahead.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from bisect import bisect_left
from collections.abc import Sequence

from unbroken._util.procs import pid_alive
from unbroken.storage.base import is_temp_name, temp_name, temp_owner_pid

_CURSOR = struct.Struct("<q")


class PlanWriter:
    """This process's plan: written once per :meth:`publish`, cursor advanced per read."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pid = os.getpid()
        stem = os.path.join(directory, f"{self.pid}-{uuid.uuid4().hex[:8]}")
        self.plan_path = stem + ".plan"
        self.cursor_path = stem + ".cursor"
        self._positions: dict[str, list[int]] = {}
        self._cursor = 0
        self._fd: int | None = None

    def publish(self, names: Sequence[str]) -> None:
        """Replace the plan with ``names`` (in access order) and rewind the cursor."""
        positions: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            positions.setdefault(name, []).append(i)
        tmp = os.path.join(self.directory, temp_name(os.path.basename(self.plan_path)))
        os.makedirs(self.directory, exist_ok=True)  # removed from outside: made again
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:  # the cursor too
            os.close(self._fd)
            self._fd = None
        try:
            with open(tmp, "w") as f:
                f.write("\n".join(names))
            self._positions = positions
            self._cursor = 0
            self._write_cursor()
            os.replace(tmp, self.plan_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def advance(self, name: str) -> None:
        """Record that ``name`` was read: the cursor moves past its next planned use."""
        slots = self._positions.get(name)
        if not slots:
            return
        i = bisect_left(slots, self._cursor)
        if i < len(slots):
            self._cursor = slots[i] + 1
            self._write_cursor()

    def _write_cursor(self) -> None:
        if self._fd is None:
            self._fd = os.open(self.cursor_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.pwrite(self._fd, _CURSOR.pack(self._cursor), 0)

    def close(self) -> None:
        """Withdraw the plan (the process will read nothing more)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for path in (self.plan_path, self.cursor_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class PlanReader:
    """Loads every live process's plan; parsed plans are reused until they change."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._parsed: dict[str, tuple[tuple[int, int], list[str]]] = {}

    def load(self) -> list[tuple[list[str], int]]:
        """(names, cursor) of each live plan; plans of dead processes are removed."""
        plans = []
        for stem in self.sweep_dead():
            names = self._names(stem + ".plan")
            if names is not None:
                plans.append((names, _read_cursor(stem + ".cursor")))
        return plans

    def sweep_dead(self) -> list[str]:
        """Remove the files of dead processes' plans; the live plans' paths, less '.plan'."""
        try:
            files = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        live = []
        for fname in files:
            if is_temp_name(fname):
                writer = temp_owner_pid(fname)
                if writer is None or pid_alive(writer):
                    continue  # a plan being written (its writer's own business)
            elif fname.endswith(".plan"):
                stem = os.path.join(self.directory, fname[: -len(".plan")])
                if _owner_alive(fname):
                    live.append(stem)
                    continue
            elif not fname.endswith(".cursor") or _owner_alive(fname):
                continue  # a live cursor
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, fname))
        return live

    def _names(self, path: str) -> list[str] | None:
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size)
            cached = self._parsed.get(path)
            if cached and cached[0] == stamp:
                return cached[1]
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        names = text.split("\n") if text else []
        self._parsed[path] = (stamp, names)
        return names


def _owner_alive(fname: str) -> bool:
    try:
        return pid_alive(int(fname.split("-", 1)[0]))
    except ValueError:
        return False


def _read_cursor(path: str) -> int:
    try:
        with open(path, "rb") as f:
            raw = f.read(_CURSOR.size)
    except FileNotFoundError:
        return 0
    return _CURSOR.unpack(raw)[0] if len(raw) == _CURSOR.size else 0
