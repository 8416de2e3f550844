"""The file index of a volume: relative keys, sizes and etags, listed at each start.

A sample position means "the i-th file of the sorted listing", so the index must be
the volume as it is: each dataset lists the volume when it is made, unless the node's
cached listing is recent enough (``max_age``). The listing is one per node at a
start: the first process to need it lists under a file lock and writes the result as
a JSON file in the index directory; the ranks that started meanwhile wait on the lock
and take it, since it finished after they asked. Workers get the index with the
dataset and never list. The fingerprint (a hash of keys, sizes and etags) ties a
saved data position to exactly this file set: resuming against a changed volume is
refused, never silently wrong. The local cache names its files by (size, etag), so a
file that changed is fetched again once the index has seen the change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

from unbroken.storage import Entry, Store, StoreError
from unbroken.storage.base import temp_name
from unbroken.storage.errors import RetriesExhaustedError, redact

INDEX_FORMAT = 1
SLOW_LISTING = 30.0
"""Seconds: a start whose listing took longer says how to reuse listings instead."""

log = logging.getLogger(__name__)


class EmptyVolumeError(ValueError):
    """The volume has no file that the include/exclude patterns select."""


class StringTable:
    """Many strings in one bytes blob plus an offsets array: a few objects, not millions.

    A forked DataLoader worker touching a list of a million ``str`` objects bumps their
    refcounts and so copies every page they live on; a blob and an array of offsets are
    never written after the fork, so all workers keep sharing one copy.
    """

    def __init__(self, values: Sequence[str]) -> None:
        encoded = [v.encode() for v in values]
        self._blob = b"".join(encoded)
        self._ends = array("q", itertools.accumulate(len(e) for e in encoded))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> str:
        start = self._ends[i - 1] if i > 0 else 0
        return self._blob[start : self._ends[i]].decode()

    def tolist(self) -> list[str]:
        ends = self._ends.tolist()
        blob = self._blob
        return [blob[a:b].decode() for a, b in zip([0, *ends[:-1]], ends)]


class FileIndex:
    """Every file of the volume selected by the patterns, sorted by key.

    Sample ``i`` is ``index[i]``, an :class:`Entry` made on demand.
    """

    def __init__(self, url: str, entries: Sequence[Entry], fingerprint: str) -> None:
        self._fill(
            url, [e.key for e in entries], [e.size for e in entries],
            [e.etag for e in entries], fingerprint,
        )  # fmt: skip

    @classmethod
    def from_columns(
        cls,
        url: str,
        keys: Sequence[str],
        sizes: Sequence[int],
        etags: Sequence[str | None],
        fingerprint: str,
    ) -> FileIndex:
        """The index of entries given as three columns (a million Entry objects cost
        seconds to make and to take apart)."""
        index = cls.__new__(cls)
        index._fill(url, keys, sizes, etags, fingerprint)
        return index

    def _fill(self, url, keys, sizes, etags, fingerprint) -> None:
        self.url = url
        """The volume's URL (credentials redacted)."""
        self.fingerprint = fingerprint
        """sha256 over keys, sizes and etags: changes whenever the file set changes."""
        self._keys = StringTable(keys)
        self._sizes = array("q", sizes)
        self._has_etag = array("b", (t is not None for t in etags))
        self._etags = StringTable([t or "" for t in etags])

    def columns(self) -> tuple[list[str], list[int], list[str | None]]:
        """Keys, sizes and etags, as lists."""
        etags = [t if has else None for t, has in zip(self._etags.tolist(), self._has_etag)]
        return self._keys.tolist(), self._sizes.tolist(), etags

    def __len__(self) -> int:
        return len(self._sizes)

    def files_digest(self) -> str:
        """sha256 over keys and sizes alone: equal for copies of one volume whose versions
        differ (each node's copy on its own disk has other modification times)."""
        keys = map(self._keys.__getitem__, range(len(self)))
        return fingerprint_columns(keys, self._sizes, itertools.repeat(None))

    def __getitem__(self, i: int) -> Entry:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} outside the {len(self)} files of {self.url}")
        i %= len(self)
        etag = self._etags[i] if self._has_etag[i] else None
        return Entry(self._keys[i], self._sizes[i], etag)

    @functools.cached_property
    def total_bytes(self) -> int:
        """Bytes of all the files together."""
        return sum(self._sizes)

    @property
    def entries(self) -> list[Entry]:
        """All entries (materialised: for tests and small volumes)."""
        return [self[i] for i in range(len(self))]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileIndex):
            return NotImplemented
        return (self.url, self.fingerprint, len(self)) == (other.url, other.fingerprint, len(other))

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"FileIndex({self.url!r}, {len(self)} files, fingerprint={self.fingerprint[:12]})"


def select(
    entries: Sequence[Entry],
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> list[Entry]:
    """Entries whose key matches an include glob (all if none) and no exclude glob.

    Globs are matched against the whole relative key with ``fnmatch`` rules, where
    ``*`` also crosses '/': ``"*.jpg"`` selects JPEGs at any depth.
    """
    inc = [re.compile(fnmatch.translate(p)).match for p in include or []]
    exc = [re.compile(fnmatch.translate(p)).match for p in exclude or []]
    if inc or exc:
        entries = [
            e
            for e in entries
            if (not inc or any(m(e.key) for m in inc)) and not any(m(e.key) for m in exc)
        ]
    return sorted(entries, key=_key)  # keys are unique: the order of Entry itself, faster


def _selectable(key: str, include: Sequence[str] | None, exclude: Sequence[str] | None) -> bool:
    """Whether ``key`` (a folder's ends with '/') names, or may hold, a file that
    ``include`` and ``exclude`` select. A folder is out when an exclude glob matches a
    file in it (``".private/*"``, not ``"log?"``) or no include glob's fixed start can lie
    under it."""
    if not key.endswith("/"):
        return bool(select([Entry(key, 0)], include, exclude))
    if any(fnmatch.fnmatchcase(key + "\0", p) for p in _patterns(exclude)):  # any file in it
        return False
    starts = [re.split(r"[*?\[]", p, maxsplit=1)[0] for p in _patterns(include)]
    return not starts or any(s.startswith(key) or key.startswith(s) for s in starts)


def _utf8(key: str) -> bool:
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def _key(entry: Entry) -> str:
    return entry.key


def fingerprint(entries: Sequence[Entry]) -> str:
    return fingerprint_columns(
        [e.key for e in entries], [e.size for e in entries], [e.etag for e in entries]
    )


def fingerprint_columns(
    keys: Iterable[str], sizes: Iterable[int], etags: Iterable[str | None]
) -> str:
    """sha256 over one ``key\0size\0etag\n`` line per entry (hashed in blocks)."""
    h = hashlib.sha256()
    rows = zip(keys, sizes, etags)
    while block := list(itertools.islice(rows, 1 << 16)):
        h.update("".join(f"{k}\0{s}\0{t or ''}\n" for k, s, t in block).encode())
    return h.hexdigest()


@contextlib.contextmanager
def listing_progress(url: str) -> Iterator[Callable[[int], None]]:
    """A count of the files listed so far, on stderr when it is a terminal (a volume of
    millions of objects lists for minutes; nothing is drawn in logs or pipes)."""
    from tqdm import tqdm

    bar = tqdm(desc=f"listing {url}", unit=" files", file=sys.stderr, disable=None,
               leave=False, mininterval=0.5)  # fmt: skip
    try:
        yield bar.update
    finally:
        bar.close()


def build_index(
    store: Store, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> FileIndex:
    """List the volume now. Raises naming the URL if it is unreachable or empty."""
    url = redact(store.url)
    try:
        unlisted: list[tuple[str, str]] = []
        with listing_progress(url) as progress:
            listed = store.list(progress=progress, unlisted=unlisted)
    except StoreError as exc:
        raise StoreError(
            f"VolumeDataset: cannot list the volume {url}: {exc}", op="list", url=url
        ) from exc
    if any(e.key == "" for e in listed):  # the URL names one file, not a folder of them
        raise EmptyVolumeError(
            f"VolumeDataset: {url} is a file, not a folder of files: pass the folder that "
            "holds it (include=['NAME'] serves that one file alone)"
        )
    missed = [(k, why) for k, why in unlisted if _selectable(k, include, exclude)]
    if missed:  # files the user asked for, left out without a word: refused
        named = "; ".join(f"{k!r}: {why}" for k, why in missed[:5])
        first = missed[0][0] + ("*" if missed[0][0].endswith("/") else "")
        raise StoreError(
            f"VolumeDataset: {len(missed)} path(s) at {url} cannot be listed, and files "
            f"under them would be missing from the dataset: {named}. Make them readable, "
            f"put the files themselves in place of links, or leave them out with "
            f"exclude=[{first!r}]",
            op="list",
            url=url,
        )
    entries = select(listed, _patterns(include), _patterns(exclude))
    unreadable = [e.key for e in entries if "\\" in e.key]
    if unreadable:  # listed, but no store reads such a key back: refused now, not mid-epoch
        raise ValueError(
            f"VolumeDataset: {len(unreadable)} file(s) at {url} have a backslash in their "
            f"name, which no store key may hold: {', '.join(map(repr, unreadable[:5]))}; "
            "rename them, or leave them out with exclude=['*\\\\*']"
        )
    undecodable = [e.key for e in entries if not _utf8(e.key)]
    if undecodable:  # a file system's bytes in no encoding: no store key may hold them
        raise ValueError(
            f"VolumeDataset: {len(undecodable)} file(s) at {url} have a name that is not "
            f"UTF-8: {', '.join(map(repr, undecodable[:5]))}; rename them (convmv -f "
            "latin1 -t utf8), or leave them out with exclude=[...]"
        )
    if not entries:
        raise EmptyVolumeError(
            f"VolumeDataset: no files at {url} ({len(listed)} listed; include={include!r}, "
            f"exclude={exclude!r}). Is the URL right, and does the volume hold any files?"
        )
    keys, sizes, etags = (
        [e.key for e in entries],
        [e.size for e in entries],
        [e.etag for e in entries],
    )
    return FileIndex.from_columns(url, keys, sizes, etags, fingerprint_columns(keys, sizes, etags))


def load_or_build_index(
    store: Store,
    index_dir: str | None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    *,
    refresh: bool = False,
    max_age: float | None = 0.0,
) -> FileIndex:
    """The volume's index: the node's cached listing if it is fresh, else a new one.

    A cached listing is used if it finished after this call began (another process
    listed while this one waited for it), or if it is at most ``max_age`` seconds old
    (``None``: however old; for a volume that never changes), or, with a warning, if
    the volume cannot be listed now. ``refresh=True`` takes only a listing that
    finished after this call began. ``index_dir=None`` lists without caching.
    """
    include, exclude = _patterns(include), _patterns(exclude)
    max_age = check_max_age(max_age)
    if index_dir is None:
        return build_index(store, include, exclude)
    if refresh:
        max_age = 0.0
    path = os.path.join(index_dir, f"index-{_cache_key(store.url, include, exclude)}.json")
    arrived = _stamp(path)  # what was there before asking: a later listing is fresh
    if _recent(arrived, max_age) and (cached := _read(path, store.url)) is not None:
        return cached
    try:
        os.makedirs(index_dir, exist_ok=True)
        lock = open(path + ".lock", "a+")  # noqa: SIM115 (closed below)
    except OSError as exc:  # a read-only or full disk: list, and say why it is not kept
        log.warning("file index not cached in %s (%s); listing %s", index_dir, exc, store)
        return build_index(store, include, exclude)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one lister per node; the rest wait and read
        now = _stamp(path)
        fresh = now is not None and (now != arrived or _recent(now, max_age))
        if fresh and (cached := _read(path, store.url)) is not None:
            return cached
        started = time.monotonic()
        try:
            index = build_index(store, include, exclude)
        except StoreError as exc:  # the remote is down: the node's last listing still serves
            if refresh or not _unreachable(exc) or (cached := _read(path, store.url)) is None:
                raise  # not an outage (a path refused, a key no client lists): say it
            log.warning(
                "%s; using this node's listing of %s from %s (%d files) instead",
                exc, cached.url, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now[1] / 1e9)),
                len(cached),
            )  # fmt: skip
            return cached
        if (took := time.monotonic() - started) > SLOW_LISTING and max_age is not None:
            log.warning(
                "listing %d files of %s took %.0f s at this start (the node's ranks share it); "
                "VolumeDataset(index_max_age=SECONDS) reuses a node's listing up to that old, "
                "index_max_age=None however old, if the volume does not change that often",
                len(index), index.url, took,
            )  # fmt: skip
        try:
            _write(path, index, store.url, include, exclude)
        except OSError as exc:
            log.warning("file index not cached at %s: %s", path, exc)
        return index


def _unreachable(exc: BaseException) -> bool:
    """Whether a listing failed because the store did not answer (its retries spent, a
    dead mount) or refused access (a key rotated): what the node's last listing, and the
    files cached, may bridge; not because of what the volume holds (a refused path, a
    key no client lists), which every start must say."""
    node: BaseException | None = exc
    while node is not None:
        if isinstance(node, (RetriesExhaustedError, PermissionError)):
            return True
        if isinstance(node, OSError) and node.errno in _UNANSWERED:
            return True
        node = node.__cause__
    return False


_UNANSWERED = {
    errno.ENOTCONN,  # a FUSE mount whose daemon died
    errno.ESTALE,  # an NFS handle gone stale
    errno.EIO,
    errno.EHOSTDOWN,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.ECONNREFUSED,
}


def check_max_age(max_age: object) -> float | None:
    """``max_age`` as seconds (or None), refused unless a finite number >= 0."""
    if max_age is None:
        return None
    ok = isinstance(max_age, (int, float)) and not isinstance(max_age, bool)
    if not ok or not math.isfinite(max_age) or max_age < 0:
        raise ValueError(
            f"VolumeDataset: index_max_age must be seconds >= 0 or None, got {max_age!r}"
        )
    return float(max_age)


def _stamp(path: str) -> tuple[int, int] | None:
    """Which listing is at ``path`` (inode, mtime): every write replaces the file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _recent(stamp: tuple[int, int] | None, max_age: float | None) -> bool:
    if stamp is None:
        return False
    if max_age is None:
        return True
    age = time.time() - stamp[1] / 1e9
    return 0 <= age <= max_age  # a listing from the future (a clock set back) is not trusted


def _patterns(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(p) for p in value]


def _cache_key(url: str, include: list[str], exclude: list[str]) -> str:
    blob = json.dumps([INDEX_FORMAT, url, include, exclude])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _write(path: str, index: FileIndex, url: str, include: list[str], exclude: list[str]):
    keys, sizes, etags = index.columns()
    doc = {
        "format": INDEX_FORMAT,
        "url": redact(url),
        "include": include,
        "exclude": exclude,
        "fingerprint": index.fingerprint,
        "keys": keys,
        "sizes": sizes,
        "etags": etags,
    }
    tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path)))
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read(path: str, url: str) -> FileIndex | None:
    """The cached index, or None if absent or unusable (then it is rebuilt)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != INDEX_FORMAT or doc.get("url") != redact(url):
            return None
        keys, sizes, etags = doc["keys"], doc["sizes"], doc["etags"]
        well_typed = (
            len(keys) == len(sizes) == len(etags)
            and all(type(k) is str for k in keys)
            and all(type(n) is int for n in sizes)
            and all(t is None or type(t) is str for t in etags)
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not well_typed or not keys:
        return None
    if fingerprint_columns(keys, sizes, etags) != doc.get("fingerprint"):
        return None
    return FileIndex.from_columns(redact(url), keys, sizes, etags, doc["fingerprint"])
