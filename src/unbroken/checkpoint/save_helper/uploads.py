"""Where the pipeline hands a save's uploads to the helper, and when it has one."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from unbroken.checkpoint.format.manifest import FileRecord
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.save_helper.client import SaveHelper, SaveHelperUnusable
from unbroken.storage import EmulatedStore, FsspecStore, Store
from unbroken.storage.errors import redact
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


class HelperSlot:
    """The rank's save helper as the pipeline's worker thread holds it: started once,
    where it pays (``start_helper``), by that thread (the kernel ends the helper with the
    thread that started it, PR_SET_PDEATHSIG, and the worker lives as long as the
    pipeline); given up for good once it proves unusable, after which the rank's own
    threads upload, as with ``save_helper=False``."""

    def __init__(self, durable: Store, memory: MemoryTier | None, config: PipelineConfig) -> None:
        self._durable, self._memory, self._config = durable, memory, config
        self.helper: SaveHelper | None = None
        self._tried = False

    def get(self) -> SaveHelper | None:
        """The helper, started at the first call; None where the rank has none."""
        if not self._tried:
            self._tried = True
            self.helper = start_helper(self._durable, self._memory, self._config)
        return self.helper

    def upload(
        self, helper: SaveHelper, local_dir: str, name: str, records: list[FileRecord]
    ) -> dict[str, str | None] | None:
        """Upload each record's file of ``local_dir`` to ``name/<file>`` from ``helper``;
        each file's etag as it stood right after its upload. None where the helper cannot
        start (said once): the caller uploads on its threads, and so does every later save."""
        files = [(os.path.join(local_dir, r.name), f"{name}/{r.name}") for r in records]
        try:
            etags = helper.upload(files, self._config.upload_streams)
        except SaveHelperUnusable as e:
            log.warning(
                "checkpoint uploads to %s run in the training process from now on: %s",
                redact(self._durable.url),
                e,
            )
            self.helper = None
            helper.close()
            return None
        return {r.name: etags.get(f"{name}/{r.name}") for r in records}

    def close(self) -> None:
        if self.helper is not None:
            self.helper.close()


def _remote(store: Store) -> bool:
    return isinstance(store, (NativeStore, FsspecStore, EmulatedStore))
