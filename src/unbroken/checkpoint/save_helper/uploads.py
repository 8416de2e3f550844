"""Where the pipeline hands a save's uploads to the helper, and when it has one."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from unbroken.checkpoint.format.manifest import FileRecord
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.save_helper.client import SaveHelper
from unbroken.storage import EmulatedStore, FsspecStore, Store
from unbroken.storage.native_store import NativeStore
from unbroken.storage.spec import store_spec

if TYPE_CHECKING:
    from unbroken.checkpoint.pipeline import PipelineConfig

log = logging.getLogger(__name__)


def start_helper(
    durable: Store, memory: MemoryTier | None, config: PipelineConfig
) -> SaveHelper | None:
    """A helper where it takes work off the training process: saves go to the memory
    tier, the durable tier is an object store (or the emulated remote), and another
    process can open it. None elsewhere (a path's copy is the kernel's work)."""
    if not config.save_helper or memory is None or not memory.active:
        return None
    if not _remote(durable):
        return None
    spec = store_spec(durable)
    if spec is None:
        log.info(
            "checkpoint uploads to %s run in the training process: another process cannot "
            "open this store from its description",
            durable.url,
        )
        return None
    try:
        return SaveHelper(spec, lower_priority=config.lower_priority)
    except OSError as e:
        log.warning("checkpoint uploads run in the training process: no save helper (%s)", e)
        return None


def upload_from_helper(
    helper: SaveHelper, local_dir: str, name: str, records: list[FileRecord], config: PipelineConfig
) -> dict[str, str | None]:
    """Upload each record's file of ``local_dir`` to ``name/<file>`` from the helper; each
    file's etag as it stood right after its upload."""
    files = [(os.path.join(local_dir, r.name), f"{name}/{r.name}") for r in records]
    etags = helper.upload(files, config.upload_streams)
    return {r.name: etags.get(f"{name}/{r.name}") for r in records}


def _remote(store: Store) -> bool:
    return isinstance(store, (NativeStore, FsspecStore, EmulatedStore))
