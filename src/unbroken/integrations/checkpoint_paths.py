"""The paths a framework saved under that no checkpoint of that step records.

A committed step is never written twice, so when Lightning's ``ModelCheckpoint`` or a
``fabric.save`` saves under a path at a step already committed (or in flight), the
step's manifest keeps the path it was first saved under, and the new path would name
nothing. Such a path is recorded here as an alias, ``path -> step``: one small JSON
object per path under ``lightning-paths/`` in the checkpoint root. Everything that lists
checkpoints (retention, ``unbroken ls``, ``verify``) reads only ``step-*`` directories,
so the folder is left alone; an alias whose step is not committed is not followed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from unbroken.storage import LocalStore, ObjectNotFoundError, Store

log = logging.getLogger(__name__)

FOLDER = "lightning-paths"
"""The folder of the aliases, in the checkpoint root beside the step directories."""


def inside(store: Store, path: str) -> bool:
    """Whether ``path`` lies under the checkpoint root: only there does a ``step-N``
    folder in it name this run's step N (another run's would load this one's)."""
    if isinstance(store, LocalStore):
        if "://" in path:
            return path.startswith("file://") and inside(store, path[len("file://") :])
        return _real(path).startswith(_real(store.root) + os.sep)
    return path.startswith(store.url.rstrip("/") + "/")


def canonical(path: str) -> str:
    """One spelling per file, the one aliases are recorded under: absolute, with ``~``
    and links resolved (``/scratch -> /lustre/...``); a URL as given."""
    return path if "://" in path else _real(path)


def spellings(path: str) -> set[str]:
    """The ways a path given to ``load`` may have been written when it was saved under:
    as given, absolute, and canonical."""
    return {path} if "://" in path else {path, os.path.abspath(path), _real(path)}


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def alias_key(path: str) -> str:
    """The store key of ``path``'s alias: a path may hold any character, a key not."""
    return f"{FOLDER}/{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"


def record_alias(store: Store, path: str, step: int) -> None:
    """Let ``path``, however it is spelled at load, name ``step`` (replacing what it
    named before)."""
    path = canonical(path)
    record = {"path": path, "step": step}
    store.write_bytes(alias_key(path), json.dumps(record).encode())


def aliased_step(store: Store, path: str) -> int | None:
    """The step ``path``'s alias names, None without one (or one unreadable)."""
    key = alias_key(path)
    try:
        record = json.loads(store.read_bytes(key))
    except ObjectNotFoundError:
        return None
    except ValueError as e:
        log.warning("%s is not an alias unbroken wrote (%s); ignored", store.url_for(key), e)
        return None
    if not isinstance(record, dict) or record.get("path") != path:
        return None  # not ours, or another path's (a hash collision)
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def remove_alias(store: Store, path: str) -> None:
    """Forget ``path``'s alias (if any); the checkpoint it named stays."""
    for spelling in {path, canonical(path)}:
        store.delete(alias_key(spelling))
