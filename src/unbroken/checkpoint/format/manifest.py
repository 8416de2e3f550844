"""The commit record: a JSON manifest that lists every file of a checkpoint.

A checkpoint is committed iff its ``manifest.json`` parses and every file it lists exists
with the listed size. The manifest is written last, in one create-only ``write_bytes`` (a
hard link on a path, a PUT with ``If-None-Match: *`` on an object store), so it is the
commit, and a commit is never overwritten: of two jobs on one URL, one commits a step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c as _crc32c

from unbroken._version import __version__
from unbroken.checkpoint.errors import (
    CheckpointCorruptError,
    NewerFormatError,
    NoCheckpointError,
    OtherJobError,
)
from unbroken.checkpoint.format.writers import describe_writer, writer_identity
from unbroken.storage import ObjectExistsError, ObjectNotFoundError, Store
from unbroken.storage.errors import redact

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
METADATA_JSON = "metadata.json"
"""DCP metadata as JSON: what our reader uses."""
METADATA_PICKLE = ".metadata"
"""DCP metadata pickled, for vanilla ``dcp.load`` only; never read by unbroken."""
FORMAT_VERSION = 1
"""Bumped when the layout changes in a way an older reader cannot follow. Every format
keeps ``SELF_CHECKSUM``, computed as ``manifest_checksum`` does, so that an older reader
can tell a newer record from a damaged one."""
STEP_DIGITS = 12
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 8 << 20
VERIFY_STREAMS = 16
"""Files of a step looked at in parallel right after its commit."""


SELF_CHECKSUM = "manifest_crc32c"
"""The manifest's own crc32c, of its other fields in canonical JSON: the files it lists
carry theirs, and a changed digit in the plain values (an epoch, a data position) or in
a file's checksum would otherwise be read as true."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its name relative to the step directory, size, crc32c."""

    name: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds; ``files`` is keyed by ``FileRecord.name``."""

    step: int
    world_size: int
    files: dict[str, FileRecord]
    """Every file of every rank; the manifest itself is not listed."""
    library_version: str
    torch_version: str
    created: float
    """``time.time()`` when the coordinator committed."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-able fields of the manager's own (e.g. the loader position, a run id)."""

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "files": [asdict(r) for r in sorted(self.files.values(), key=lambda r: r.name)],
            "extra": self.extra,
        }
        doc[SELF_CHECKSUM] = manifest_checksum(doc)
        return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate; any defect raises CheckpointCorruptError naming ``where``."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"{where}: manifest is not valid JSON ({exc})", url=where
            ) from exc
        try:
            if not isinstance(doc, dict):
                raise TypeError("top level is not an object")
            fmt = doc.get("format")
            newer = _is_int(fmt) and fmt > FORMAT_VERSION
            # The checksum first: a flipped bit in "format" must read as damage, not as a
            # newer unbroken's checkpoint (which restore refuses instead of falling back).
            _check_self_checksum(doc, required=newer)
            if newer:
                raise _newer_format(doc, fmt, where)  # its other fields may mean other things
            if not _is_int(fmt) or fmt != FORMAT_VERSION:
                raise ValueError(f"unknown manifest format {fmt!r}")
            files: dict[str, FileRecord] = {}
            for item in doc["files"]:
                rec = FileRecord(str(item["name"]), _nonneg(item["size"]), _nonneg(item["crc32c"]))
                _check_file_name(rec.name)
                if rec.name in files:
                    raise ValueError(f"file {rec.name!r} listed twice")
                files[rec.name] = rec
            extra = doc.get("extra", {})
            if not isinstance(extra, dict):
                raise TypeError("extra is not an object")
            world_size = _nonneg(doc["world_size"])
            if world_size < 1:
                raise ValueError("world_size is 0")
            return cls(
                step=_nonneg(doc["step"]),
                world_size=world_size,
                files=files,
                library_version=str(doc["library_version"]),
                torch_version=str(doc["torch_version"]),
                created=float(doc["created"]),
                extra=extra,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"{where}: malformed manifest ({type(exc).__name__}: {exc})", url=where
            ) from exc


def manifest_checksum(doc: dict[str, Any]) -> int:
    """crc32c of a manifest document's fields other than ``SELF_CHECKSUM``, as compact
    JSON with sorted keys (the same bytes for the same values, however it was indented)."""
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    return crc32c_bytes(
        json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    )


def _check_self_checksum(doc: dict[str, Any], *, required: bool) -> None:
    """Manifests of this format written before the field existed have none, and are taken
    as they are. One that claims a newer format must carry it (every format keeps it,
    computed as ``manifest_checksum`` does): only a record whose checksum holds is believed
    when it says a newer unbroken wrote it."""
    if SELF_CHECKSUM not in doc:
        if required:
            raise ValueError(
                f"it claims format {doc.get('format')!r} but carries no {SELF_CHECKSUM}, "
                "which every newer format writes: the record is damaged"
            )
        return
    expected, actual = doc[SELF_CHECKSUM], manifest_checksum(doc)
    if expected != actual:
        raise ValueError(
            f"its own checksum does not match its contents ({SELF_CHECKSUM} {expected!r}, "
            f"contents {actual}): it changed after it was written"
        )


def new_manifest(
    step: int,
    world_size: int,
    records: Iterable[FileRecord],
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest for files reported by all ranks, stamped with versions and time.

    The same name reported twice with different size or checksum is an error (two ranks
    wrote one file): committing would hide which copy is real.
    """
    files: dict[str, FileRecord] = {}
    for rec in records:
        _check_file_name(rec.name)
        seen = files.setdefault(rec.name, rec)
        if seen != rec:
            raise ValueError(f"step {step}: file {rec.name!r} reported twice: {seen} vs {rec}")
    import torch  # here, so that listing checkpoints does not import torch

    return Manifest(
        step=step,
        world_size=world_size,
        files=files,
        library_version=__version__,
        torch_version=torch.__version__,
        created=time.time(),
        extra=dict(extra or {}),
    )


def _newer_format(doc: dict[str, Any], fmt: int, where: str) -> NewerFormatError:
    """The refusal of a manifest a newer unbroken wrote: only the fields every format
    keeps (step, writer's version) are read from it, and only to say so."""
    step = doc.get("step") if _is_int(doc.get("step")) else None
    version = doc.get("library_version")
    version = version[:40] if isinstance(version, str) else "(version not recorded)"
    what = f"step {step}" if step is not None else "this checkpoint"
    return NewerFormatError(
        f"{where}: {what} was written by unbroken {version} (format {fmt}); this is "
        f"unbroken {__version__}, which reads format {FORMAT_VERSION}: upgrade unbroken to "
        "restore it (it is never deleted or overwritten)",
        step=step,
        format=fmt,
        library_version=version,
        url=where,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonneg(value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _check_file_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad file name {name!r} (must be relative, without '..')")
    if name == MANIFEST_NAME:
        raise ValueError(f"{MANIFEST_NAME} must not list itself")


def check_step(step: object) -> None:
    """Refuse what ``step_dir`` cannot name (a bool, a float, a string, a negative)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")


STEP_DIRS_AFTER = "step-"
"""Every step directory's keys sort after this: a listing of the steps starts there,
past what sorts before (the goodput log's ``_goodput/``, one object per rank and
attempt, tens of thousands in a long job on many ranks)."""


def step_dir(step: int) -> str:
    """``step-000000001200``: zero-padded so that lexical order is step order."""
    check_step(step)
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-*`` directory name as ``step_dir`` writes it, or None.

    A name that is not canonical (``step-0000000000099``, 13 digits) is None too: read as
    step 99 it would send every reader to ``step-000000000099``, which is another
    directory (see ``odd_step_dir``)."""
    m = _STEP_DIR.match(name.strip("/"))
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name.strip("/") else None


def odd_step_dir(name: str) -> bool:
    """``step-`` and digits, but not a name ``step_dir`` writes: not ours to read or delete."""
    return _STEP_DIR.match(name.strip("/")) is not None and parse_step_dir(name) is None


def crc32c_bytes(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """crc32c of ``data``, continuing from ``value`` (the crc of what came before)."""
    return _crc32c.crc32c(data, value)


def crc32c_file(path: str | os.PathLike) -> int:
    """crc32c of a whole local file, read in bounded chunks."""
    value = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            value = _crc32c.crc32c(view[:n], value)
    return value


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def committed_by(store: Store, step: int, *, guess: bool = True) -> str:
    """' by <the job that wrote it> (...)' for a step another process committed, '' when
    this process did (or the record cannot be read: the caller's words stand). An earlier
    attempt of this job (or run) committed it where this run restored an older step: the
    newer one was unusable (corrupt), or ``restore(step=)`` chose the older."""
    try:
        writer = read_manifest(store, step).extra.get("writer")
    except Exception:
        return ""
    mine = writer_identity()
    if isinstance(writer, dict) and writer == mine:
        return ""
    if isinstance(writer, dict) and mine["job"] is not None and writer.get("job") == mine["job"]:
        return (
            f" by an earlier attempt of this job ({describe_writer(writer)}), after the "
            "step this run restored"
        )
    if not guess:  # the caller knows why
        return f" by {describe_writer(writer)}"
    return (
        f" by {describe_writer(writer)} (two jobs saving to one URL, or an earlier run "
        "whose newer steps this run's restore passed over as unusable?)"
    )


def committed_refusal(store: Store, step: int, *, passed_over: bool) -> str:
    """Why a save of ``step``, committed already, is refused. ``passed_over``: this run's
    restore found it unusable and loaded an older one, then trained up to it again."""
    where = store.url_for(step_dir(step))
    if passed_over:  # every restart would retrain to it and fail here: say what to do
        return (
            f"step {step} is committed at {where}{committed_by(store, step, guess=False)}, "
            "but this run's restore found it unusable "
            "and loaded an older step (its warning says why); a committed checkpoint is "
            f"never overwritten, so step {step} is not saved. Check it with `unbroken verify "
            f"{redact(store.url)} --step {step}`: if it is damaged, delete {where} to save it "
            "again; if not (the restore could not read it then), restart: the restore loads it"
        )
    return (
        f"step {step} is already committed at {where}{committed_by(store, step)}; a "
        "committed checkpoint is never overwritten"
    )


def write_manifest(store: Store, manifest: Manifest) -> None:
    """Commit a checkpoint: one atomic, create-only write of its manifest, after all its
    files landed. Of two jobs committing the same step to one URL, one wins; the other
    gets OtherJobError naming both, and nothing is overwritten."""
    key = manifest_key(manifest.step)
    data = manifest.to_json()
    try:
        store.write_bytes(key, data, create_only=True)
    except ObjectExistsError as exc:
        try:
            there = store.read_bytes(key)
            if there == data:
                return  # this very record: a retried write whose first try landed
            other = Manifest.from_json(there, where=store.url_for(key))
            who = describe_writer(other.extra.get("writer"))
        except Exception as read_exc:  # still refuse: the record is there
            who = f"another writer (its manifest cannot be read: {read_exc})"
        me = describe_writer(manifest.extra.get("writer"))
        # The coordinator knew the step uncommitted when it claimed it: the winner
        # committed since, so it runs now, and the next steps will meet it again.
        raise OtherJobError(
            f"two jobs are saving to one URL: step {manifest.step} was committed at "
            f"{store.url_for(key)} by {who}, not by this job ({me}), while this job saved "
            "it; this job's save of the step is not committed. Give each job its own URL.",
            step=manifest.step,
            url=store.url_for(key),
            this_job=me,
            other_job=who,
        ) from exc


GONE_RECHECK_SECONDS = 1.0
"""A file missing right after the commit is looked at again after this long."""


def verify_committed_files(
    store: Store, manifest: Manifest, etags: dict[str, str | None]
) -> list[str]:
    """The files of a just-committed step whose durable object changed since this job
    uploaded it (another writer's upload landed over it); [] when all are this job's.

    ``etags``: file name -> the etag each rank read right after its upload. The files
    are looked at in parallel: on a far store each look is a round trip, and a step of N
    ranks has 2N + 2 files."""
    prefix = step_dir(manifest.step)

    def changed(item: tuple[str, FileRecord]) -> str | None:
        name, rec = item
        try:
            entry = store.info(f"{prefix}/{name}")
        except ObjectNotFoundError:
            return f"{name} (gone)"
        except Exception as exc:  # a look that failed proves nothing: the commit stands
            log.warning("step %d: %s not checked after the commit: %s", manifest.step, name, exc)
            return None
        mine = etags.get(name)
        if entry.size != rec.size or (mine is not None and entry.etag != mine):
            return name
        return None

    items = sorted(manifest.files.items())
    try:
        with ThreadPoolExecutor(max(1, min(VERIFY_STREAMS, len(items)))) as pool:
            found = [c for c in pool.map(changed, items) if c is not None]
    except RuntimeError as exc:  # no new thread at the interpreter's shutdown
        log.warning("step %d: files not checked after the commit: %s", manifest.step, exc)
        return []
    if any(c.endswith(" (gone)") for c in found):  # one 404 may be the store's hiccup:
        time.sleep(GONE_RECHECK_SECONDS)  # a file deleted by another job stays gone
        looked = [(n, manifest.files[n]) for n in (c.split(" (gone)")[0] for c in found)]
        found = [c for c in map(changed, looked) if c is not None]
    return found


def read_manifest(store: Store, step: int) -> Manifest:
    """The manifest of ``step``; NoCheckpointError if absent, CheckpointCorruptError if bad."""
    key = manifest_key(step)
    url = store.url_for(key)
    try:
        data = store.read_bytes(key)
    except ObjectNotFoundError as exc:
        raise NoCheckpointError(f"step {step}: no manifest at {url} (not committed)") from exc
    manifest = Manifest.from_json(data, where=url)
    if manifest.step != step:
        raise CheckpointCorruptError(
            f"{url}: manifest says step {manifest.step}, directory says step {step}",
            step=step,
            file=MANIFEST_NAME,
            url=url,
        )
    return manifest
