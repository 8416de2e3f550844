"""A save's copy on this node: the memory tier while it has room, else the staging
directory on disk; the arenas the next saves stage straight into; the replica of each
commit sent on to other nodes.

The save pipeline asks here where a step's local copy goes and tells this what became of
it (written, committed, failed); what the node keeps between saves is decided here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from unbroken._util.sizes import format_size
from unbroken.checkpoint import staging_tier
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, FileRecord, crc32c_bytes, step_dir
from unbroken.checkpoint.format.shard_layout import TensorLayout
from unbroken.checkpoint.memory_tier import MemoryTier
from unbroken.checkpoint.peers.replica_files import drop_all as drop_replicas
from unbroken.checkpoint.peers.replicator import Replica, Replicator
from unbroken.checkpoint.save_job import SaveJob, describe, rng_file
from unbroken.checkpoint.staging.arena import Arena, RankArenas
from unbroken.storage import LocalStore

log = logging.getLogger(__name__)


class NodeCopies:
    """This rank's tiers on its node (memory, then disk) and what each keeps."""

    def __init__(
        self,
        staging_dir: str,
        rank: int,
        memory: MemoryTier | None = None,
        *,
        stage_in_place: bool = True,
        on_arena: Callable[[TensorLayout], None] | None = None,
        replicator: Replicator | None = None,
    ) -> None:
        self.staging_dir = staging_dir
        self.rank = rank
        self.memory = memory
        """The node's memory tier: where a save's local copy goes while it has room."""
        self.replicator = replicator
        """Sends each commit's files from the memory tier to the replica nodes."""
        self.stores = {staging_dir: LocalStore(staging_dir)}
        """Each local tier's root, as a store."""
        if memory is not None:
            self.stores[memory.path] = LocalStore(memory.path)
        # Versions before O_DIRECT staging kept superseded shards here between saves.
        shutil.rmtree(os.path.join(staging_dir, ".spare"), ignore_errors=True)
        self.arenas = RankArenas(memory.path, rank) if memory and stage_in_place else None
        """This rank's files of the memory tier that saves stage straight into."""
        self.layout: TensorLayout | None = None
        """This rank's shard as the last save wrote it to the memory tier."""
        self._shard_bytes: int | None = None
        """The size of this rank's shard as the last save wrote it, to either tier."""
        self._said_room = False
        """Whether dropping an older copy for room was warned about (once, then info)."""
        self._on_arena = on_arena
        """Told, before an arena of a layout is made, that the next saves stage its
        tensors there (the stager drops its own buffers of them)."""
        self._arena_ready = True
        """The last ``prepare`` left an arena ready (or had nothing to make)."""

    def memory_store(self) -> LocalStore | None:
        """The memory tier as a store, for restore (None: no memory tier)."""
        return self.stores.get(self.memory.path) if self.memory is not None else None

    def in_memory(self, root: str) -> bool:
        """Whether ``root`` (from :meth:`choose`) is the memory tier."""
        return self.memory is not None and root == self.memory.path

    def arena(self) -> Arena | None:
        """Where the next snapshot can stage in the memory tier: a file of this rank's
        laid out as its last shard there, once no step or snapshot holds it; None
        otherwise."""
        if self.arenas is None or self.memory is None or not self.memory.active:
            return None
        return self.arenas.take(self.layout)

    def begin(self, step: int, current_step: int | None) -> None:
        """Before ``step``'s local write: the durable tier has no commit of it, so a local
        manifest of it is stale (a reused staging_dir) and is removed before the copy is
        written over; older copies but ``current_step``'s go."""
        name = step_dir(step)
        for root in self.stores:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name, MANIFEST_NAME))
            staging_tier.tidy(root, current_step, writing=step)

    def bytes_to_write(self, stats: dict[str, float]) -> int:
        """What a snapshot's local copies add to the memory tier, from this rank's
        staging ``stats``, for the whole node: its ranks check the room at the same
        moment, each would find room for its own bytes, and together fill past the cap.
        A rank stages every tensor it holds, but writes only those of its shard (DCP
        writes DDP's replicated tensors once, spread over the ranks), and those staged in
        place are in the tier already. Once a shard was written: its size less what is
        in place, plus tensors new since; before, every byte staged apart."""
        staged, in_place = stats.get("bytes", 0.0), stats.get("bytes_in_place", 0.0)
        if self._shard_bytes is None:
            own = staged - in_place
        else:
            own = max(0.0, self._shard_bytes - in_place) + stats.get("bytes_new", staged)
        return int(own) * (self.memory.ranks() if self.memory is not None else _local_ranks())

    def choose(self, nbytes: int, step: int) -> str:
        """Where ``step``'s local copy goes: the memory tier while it has room for
        ``nbytes`` more, else the disk staging tier. Never raises: every rank goes on to
        the same collectives (a disk that refuses fails the local write, on every rank
        alike)."""
        name = step_dir(step)
        memory = self.memory
        tight = memory is not None and memory.active and not memory.room_now(nbytes)
        if tight and memory is not None:  # other nodes' replicas go first, then idle arenas
            freed = drop_replicas(memory.path)
            if freed:
                log.warning(
                    "memory tier %s: dropped %s of other nodes' replicas to make room for "
                    "step %s", memory.path, format_size(freed), name,
                )  # fmt: skip
            tight = not memory.room_now(nbytes)
        if tight and self.arenas is not None:  # an idle arena's pages make room for this copy
            self.arenas.drop_free()
        if memory is not None and memory.active and memory.has_room(nbytes):
            try:
                os.makedirs(os.path.join(memory.path, name), exist_ok=True)
                return memory.path
            except OSError as e:
                memory.active = False
                log.warning("memory tier %s is off: %s", memory.path, describe(e))
        if staging_tier.free_bytes(self.staging_dir) < nbytes:  # the older copy makes room
            dropped = staging_tier.drop_copies(self.staging_dir, keep=step)
            if dropped:
                said, self._said_room = self._said_room, True
                (log.info if said else log.warning)(
                    "staging tier %s: too little room for step %s beside %s; dropped that "
                    "copy (the durable tier holds it: a restart reads it from there)",
                    self.staging_dir, name, ", ".join(dropped),
                )  # fmt: skip
        with contextlib.suppress(OSError):
            os.makedirs(os.path.join(self.staging_dir, name), exist_ok=True)
        return self.staging_dir

    def written(self, root: str, layout: TensorLayout, snapshot_released: bool) -> None:
        """The local write to ``root`` is done, laid out as ``layout``. The first arena is
        made here (not in the training loop) once the snapshot's buffers are free; a
        spare waits for the commit to tidy the older step."""
        self.layout = layout if self.in_memory(root) else None
        self._shard_bytes = layout.end
        if snapshot_released:
            self.prepare_arenas(spare=False)

    def write_rng(self, local_dir: str, rng: dict[str, Any]) -> FileRecord:
        """This rank's RNG states beside its shard; their record for the manifest."""
        name = rng_file(self.rank)
        data = json.dumps(rng, sort_keys=True).encode()
        store = self.stores[os.path.dirname(local_dir)]
        store.write_bytes(f"{os.path.basename(local_dir)}/{name}", data)
        return FileRecord(name=name, size=len(data), crc32c=crc32c_bytes(data))

    def committed(self, root: str, step: int, manifest: bytes) -> None:
        """The local copy counts as whole once its manifest copy is there."""
        try:
            self.stores[root].write_bytes(f"{step_dir(step)}/{MANIFEST_NAME}", manifest)
        except Exception as e:
            log.warning(
                "step %d: could not copy the manifest to the staging tier: %s", step, describe(e)
            )

    def failed(self, step: int) -> None:
        """A failed save's partial copies go from every tier; the next save's room is
        sized afresh (tensors new in the failed one were counted as seen)."""
        self._shard_bytes = None
        for root in self.stores:
            staging_tier.remove_unfinished(root, step)

    def keep_only(self, current_step: int | None) -> None:
        """After a commit: one local copy, in the step's own tier."""
        for root in self.stores:
            staging_tier.tidy(root, current_step)

    def replicate(self, job: SaveJob) -> None:
        """A commit whose node copy is in the memory tier goes on to the replica nodes
        (in the replicator's thread: the next save never waits for it)."""
        if self.replicator is None or job.manifest is None or not job.records:
            return
        if job.local_root is None or not self.in_memory(job.local_root):
            return
        self.replicator.submit(
            Replica(
                step=job.step,
                folder=os.path.join(job.local_root, step_dir(job.step)),
                files={rec.name: rec.crc32c for rec in job.records},
                manifest=job.manifest.to_json(),
            )
        )

    def prepare_arenas(self, *, spare: bool = True) -> None:
        """Make the arenas the next saves stage in, the stager's own buffers of the same
        tensors dropped first: a rank holds the state twice in host memory, never three
        times (its first save's buffers, that save's copy in the tier, the next arena;
        or, at its second save, the first save's copy, the second's and a spare)."""
        if self.arenas is None:
            return
        layout, tier, tell = self.layout, self.memory, self._on_arena
        # After a failed make the stager keeps its buffers (they would be made again
        # each save) until an arena is ready again.
        if layout and tier and tier.active and tell and self._arena_ready:
            tell(layout)
        self._arena_ready = self.arenas.prepare(layout, spare=spare)

    def close(self, *, replica_seconds: float) -> None:
        """Let the last commit's replica go on for ``replica_seconds`` at most; free the
        arenas."""
        if self.replicator is not None:
            self.replicator.close(timeout=replica_seconds)
        if self.arenas is not None:
            self.arenas.close()


def _local_ranks() -> int:
    """The ranks of this node (torchrun's LOCAL_WORLD_SIZE), which share its staging disk."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
