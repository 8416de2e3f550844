"""The memory tier: the node's copy of a checkpoint in shared memory (a tmpfs).

Most failures kill a process, not a node. A copy of the newest committed checkpoint in
``/dev/shm`` outlives the process, and a process restarted on the node reads it back at
the speed of a memory copy, where the disk tier costs a read from disk (the shards are
written with O_DIRECT, so no page cache holds them) and the durable tier a download.

Layout: the same step directories as the disk staging tier (shards, metadata, RNG files,
the manifest copy written last, which makes the copy count), under
``<root>/<key of the staging directory and the URL>/``. The root is ``unbroken-<uid>`` in
``$UNBROKEN_MEMORY_DIR`` or ``/dev/shm``: a directory of the user's own, mode 0700 (only
its owner reaches the files), never the directory named, which other programs may use
too. The tier belongs to the staging directory: two staging directories on one machine
are two nodes.

Bytes are accounted for: the tier holds the committed copy the run is at plus the one
being written (``staging_tier.tidy``), each save first checks that the tmpfs keeps
``reserve_bytes`` free after it (DataLoader workers and NCCL need /dev/shm too), and a
clean end removes the job's files. A job that died leaves its files for its own restart;
another manager on the node sweeps them once no process of the dead job (a rank or the
launcher that restarts it) is left and nothing in them changed for a while (a container
restarted in place, or the job's other nodes, may be starting again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import time
import warnings
from dataclasses import dataclass

from unbroken._util.job import job_id
from unbroken._util.procs import process_alive, process_start_ticks
from unbroken._util.sizes import format_size
from unbroken.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

MEMORY_DIR_ENV = "UNBROKEN_MEMORY_DIR"
"""A directory on a tmpfs (default ``/dev/shm``) where the memory tier keeps a folder of
its own, ``unbroken-<uid>``."""

OWNERS = ".owners"
"""A tier directory's folder of owner records, one per rank of this node."""

SWEEP_GRACE_SECONDS = 300.0
"""A tier directory no live process owns is swept only once nothing in it has changed
for this long: its job may be starting again (all its processes were killed: a container
restarted in place), and a rank of a job starting now may have made one a moment before
it writes its owner record."""

RESERVE_FRACTION = 0.1
RESERVE_MIN_BYTES = 256 << 20
RESERVE_MAX_BYTES = 4 << 30
"""What the tier leaves free on its tmpfs: a tenth of it, at least 256 MiB (at most half
of it) and at most 4 GiB. The others' needs (NCCL's buffers, DataLoader workers' batches)
do not grow with the tmpfs: a tenth of a node's 1 TB /dev/shm would refuse a tier that
fits many times over in what is free."""


class MemoryTierError(CheckpointError):
    """``memory_tier=True`` and the tier cannot be had (no tmpfs, too small)."""


def default_root() -> str:
    """``unbroken-<uid>`` in ``$UNBROKEN_MEMORY_DIR`` or ``/dev/shm``: the tier sweeps
    what it finds in its root, so the root is a folder of its own, never a directory
    (a tmpfs mount point, /dev/shm itself) that others use too."""
    base = os.environ.get(MEMORY_DIR_ENV, "").strip() or "/dev/shm"
    return os.path.join(base, f"unbroken-{_uid()}")


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _check_base(root: str) -> None:
    """The directory the root goes in must exist and be named absolutely: a misspelt
    ``$UNBROKEN_MEMORY_DIR`` would make a folder on whatever disk it names, and a
    relative one a folder per working directory."""
    base = os.path.dirname(root)
    if not os.path.isabs(base):
        raise ValueError(f"{MEMORY_DIR_ENV}={base!r} is not an absolute path")
    if not os.path.isdir(base):
        raise FileNotFoundError(
            f"{base} does not exist (the memory tier goes in a directory on a tmpfs: "
            f"/dev/shm, or {MEMORY_DIR_ENV})"
        )


def _check_own_root(root: str) -> None:
    """The root must be a real directory of this user: not a link, nor another user's
    (planted where ours would be made), since the tier writes and sweeps inside it."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{root} is not a directory (a link or a file)")
    if st.st_uid != _uid():
        raise PermissionError(f"{root} belongs to uid {st.st_uid}, not this user ({_uid()})")


def node_key(staging_dir: str) -> str:
    """A node of a job: its staging directory on this machine."""
    return _short_hash(os.path.realpath(staging_dir))


def tier_key(staging_dir: str, url: str) -> str:
    """The tier directory's name: one per node of a job (its staging directory) and per
    checkpoint URL. Jobs in containers that share the host's /dev/shm (``--ipc=host``)
    and name one staging path, each its own volume, must not share a tier: two jobs
    saving to one URL are refused anyway (``staging/owner.py``, the step claims)."""
    return _short_hash(f"{os.path.realpath(staging_dir)}\n{url}")


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Space:
    """A file system's free bytes, its size, and what the tier must leave free there."""

    free: int
    total: int

    @property
    def reserve(self) -> int:
        tenth = min(int(self.total * RESERVE_FRACTION), RESERVE_MAX_BYTES)
        return max(tenth, min(RESERVE_MIN_BYTES, self.total // 2))

    def room_for(self, nbytes: int, *, held: int = 0) -> bool:
        """Whether ``nbytes`` more fit with the reserve kept (``held``: bytes of ours
        that will be deleted first)."""
        return nbytes <= self.free + held - self.reserve


def space(path: str) -> Space:
    st = os.statvfs(path)
    return Space(free=st.f_bavail * st.f_frsize, total=st.f_blocks * st.f_frsize)


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (what deleting it would give back); a file
    linked twice (an arena and the step that holds it) counts once."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for folder, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, n))
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class MemoryTier:
    """One node's memory tier for one staging directory, as one rank uses it."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.active = True
        """False once the tier turned itself off (a tmpfs too small, a write that failed)."""
        self._told_full = False
        self._fits = 0
        """The largest state the tmpfs was found to hold two snapshots of."""

    @classmethod
    def open(
        cls, staging_dir: str, url: str, rank: int, *, required: bool, root: str | None = None
    ) -> MemoryTier | None:
        """The tier for ``staging_dir`` and checkpoint ``url``, its owner record written;
        None where it cannot be had and is not ``required`` (warned once),
        MemoryTierError where it is."""
        root = root or default_root()
        try:
            _check_base(root)
            os.makedirs(root, mode=0o700, exist_ok=True)
            _check_own_root(root)
            os.chmod(root, 0o700)
            path = os.path.join(root, tier_key(staging_dir, url))
            os.makedirs(path, mode=0o700, exist_ok=True)
            tier = cls(path, rank)
            tier._record_owner(staging_dir)  # before the sweep: another rank sweeps too
            sweep_dead(root, keep=path)
        except (OSError, ValueError) as e:
            return _unavailable(f"{root} is not usable ({type(e).__name__}: {e})", required)
        return tier

    def check_fits(self, nbytes: int, *, required: bool) -> bool:
        """Can the tmpfs hold two snapshots of ``nbytes`` (the committed one and the one
        being written)? Asked again only for a larger state (an optimizer's state appears
        at its first step). If not, the tier goes off (warned) or, where ``required``,
        MemoryTierError (at every save, until there is room)."""
        if not self.active or nbytes <= self._fits:
            return self.active
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        room = space(self.path)
        held = tree_bytes(self.path)
        if room.room_for(2 * nbytes, held=held):
            self._fits = nbytes
            return True
        message = (
            f"the memory tier at {self.path} needs {format_size(2 * nbytes)} (two snapshots "
            f"of {format_size(nbytes)}: the committed one and the one being written) and "
            f"keeps {format_size(room.reserve)} of its tmpfs free, but the tmpfs has "
            f"{format_size(room.free + held)} of {format_size(room.total)} free. Make room "
            f"(docker run --shm-size, a larger /dev/shm, or {MEMORY_DIR_ENV} on a larger "
            "tmpfs) or pass memory_tier=False"
        )
        if required:  # the tier stays on: every save is refused until there is room
            raise MemoryTierError(message)
        self.active = False
        warnings.warn(message + "; the memory tier is off", RuntimeWarning, stacklevel=3)
        return False

    def ranks(self) -> int:
        """The ranks of this node writing to the tier (its live owners; at least this
        one): they check its room at the same moment, each for its own bytes. A killed
        attempt's records (more ranks before a resize) are not counted."""
        return max(1, sum(_owner_alive(doc, launcher=False) for doc in _owner_records(self.path)))

    def room_now(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit now with the reserve kept (said nowhere)."""
        try:
            return space(self.path).room_for(nbytes)
        except OSError:
            return False

    def has_room(self, nbytes: int) -> bool:
        """Before a save's write: do ``nbytes`` fit now (the tidy has left only the
        committed copy)? Said once when not: that save goes to the disk tier."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)  # someone may have removed it
            room = space(self.path)
        except OSError as e:
            log.warning("memory tier %s is not usable now: %s", self.path, e)
            return False
        if room.room_for(nbytes):
            return True
        if not self._told_full:
            self._told_full = True
            log.warning(
                "memory tier %s: no room for %s more on its tmpfs (%s free, keeping %s); "
                "saves go to the disk tier until there is",
                self.path,
                format_size(nbytes),
                format_size(room.free),
                format_size(room.reserve),
            )
        return False

    def remove_own(self) -> None:
        """A clean end: this rank's owner record goes, and the directory once no other
        rank of the node holds one (the files are the job's, not a rank's)."""
        with contextlib.suppress(OSError):
            os.unlink(self._owner_path())
        others = _owner_records(self.path)  # a killed earlier attempt's are stale
        if not any(_owner_alive(doc, launcher=False) for doc in others):
            shutil.rmtree(self.path, ignore_errors=True)

    def _owner_path(self) -> str:
        return os.path.join(self.path, OWNERS, f"rank-{self.rank:05d}.json")

    def _record_owner(self, staging_dir: str) -> None:
        os.makedirs(os.path.join(self.path, OWNERS), mode=0o700, exist_ok=True)
        parent = os.getppid()
        doc = {
            "job": job_id(),
            "pid": os.getpid(),
            "started": process_start_ticks(os.getpid()),
            # torchrun's agent restarts the ranks: the job lives while it does
            "parent": parent,
            "parent_started": process_start_ticks(parent),
            "staging_dir": os.path.realpath(staging_dir),
        }
        tmp = f"{self._owner_path()}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self._owner_path())


def _unavailable(why: str, required: bool) -> None:
    if required:
        raise MemoryTierError(f"memory_tier=True: {why}")
    warnings.warn(f"the memory tier is off: {why}", RuntimeWarning, stacklevel=4)
    return None


def _unchanged_for(path: str, seconds: float) -> bool:
    """Nothing was added to or removed from any folder of ``path`` for ``seconds`` (a
    save makes a step folder and its files, a start an owner record)."""
    newest = 0.0
    for folder, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(folder).st_mtime)
    return newest > 0 and time.time() - newest > seconds


def _is_tier_key(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _owner_records(path: str) -> list[dict]:
    """The owner records of a tier directory that can be read."""
    owners = os.path.join(path, OWNERS)
    try:
        names = [n for n in os.listdir(owners) if n.endswith(".json")]
    except OSError:
        return []
    docs = []
    for name in names:
        try:
            with open(os.path.join(owners, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def _owner_alive(doc: dict, *, launcher: bool = True) -> bool:
    """The rank that wrote ``doc`` still runs, or (``launcher``) the process that started
    it, which may start it again."""
    keys = [("pid", "started")] + ([("parent", "parent_started")] if launcher else [])
    for pid_key, started_key in keys:
        pid, started = doc.get(pid_key), doc.get(started_key)
        if not isinstance(pid, int) or pid < 1:
            continue
        # pid 1: a container's entry point (`CMD ["python", "train.py"]`) is a rank, told
        # by its start time; a parent of 1 is init, which adopted an orphan
        if pid == 1 and (pid_key == "parent" or started is None):
            continue
        if process_alive(pid, started):
            return True
    return False


def sweep_dead(root: str, *, keep: str) -> list[str]:
    """Remove the tier directories of jobs none of whose processes is left (every owner
    record names a rank and a launcher that are gone, or there is none: a half-made
    directory, a clean end's leftover) once nothing in them changed for
    ``SWEEP_GRACE_SECONDS``: a job restarting (its other nodes too) is back well within
    it. Returns what was removed; ``keep`` (ours) stays."""
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(root, name)
        if not _is_tier_key(name) or os.path.realpath(path) == os.path.realpath(keep):
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        records = _owner_records(path)
        if any(_owner_alive(doc) for doc in records):
            continue
        if _unchanged_for(path, SWEEP_GRACE_SECONDS):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("memory tier: removed %s, left by a job that is gone", path)
    return removed
