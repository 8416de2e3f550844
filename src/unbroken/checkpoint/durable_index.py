"""What the coordinator knows about the durable tier, kept current at one listing per save.

The catalog reads every manifest to decide what is committed: right for a cold look, but
on a remote with 20 ms per request it would add a round trip per kept checkpoint to every
save. The coordinator reads the catalog once, then trusts its own commits and deletions;
each retention pass costs one listing (to see partial steps) plus the deletions. A
manifest that appears without this process writing it sends it back to the catalog. A
step whose manifest a newer unbroken wrote is remembered as such: never deleted, never
saved over. The claims (``writer.json``) of that first look are remembered too: a claim
made after it proves that its writer ran while this job did.
"""

from __future__ import annotations

from unbroken.checkpoint.catalog import CheckpointInfo, list_checkpoints, step_files
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, Manifest, step_dir
from unbroken.checkpoint.format.writers import WRITER_NAME
from unbroken.storage import Store


class DurableIndex:
    """Committed checkpoints of one durable tier, as this (coordinator) process knows them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._committed: dict[int, CheckpointInfo] | None = None
        self._newer: dict[int, CheckpointInfo] = {}
        """Steps whose manifest is of a newer format than this unbroken reads."""
        self._damaged: dict[int, CheckpointInfo] = {}
        """Steps with a manifest but not whole (a file gone, cut short, or corrupt)."""
        self._first_claims: frozenset[int] | None = None
        """Steps that held a claim at the first look."""

    def committed_steps(self) -> set[int]:
        """Steps committed in the durable tier (read from the catalog the first time)."""
        if self._committed is None:
            self._reload()
        assert self._committed is not None
        return set(self._committed)

    def newest_after(self, step: int, passed_over: set[int]) -> int | None:
        """The newest committed step after ``step`` that a restart would load (not one of
        ``passed_over``, the steps a restore found unusable and went past)."""
        return max((s for s in self.committed_steps() if s > step and s not in passed_over),
                   default=None)  # fmt: skip

    def add(self, manifest: Manifest) -> None:
        """Record a commit this process just made."""
        if self._committed is None:
            self._reload()
        assert self._committed is not None
        self._committed[manifest.step] = CheckpointInfo(
            manifest.step,
            True,
            manifest.nbytes,
            manifest.created,
            manifest.world_size,
            self.store.url_for(step_dir(manifest.step)),
            None,
        )

    def newer_format(self, step: int) -> CheckpointInfo | None:
        """The entry of ``step`` if a newer unbroken committed it (its ``problem`` says so)."""
        if self._committed is None:
            self._reload()
        return self._newer.get(step)

    def damaged(self, step: int) -> CheckpointInfo | None:
        """The entry of ``step`` if it has a manifest but is not whole (``problem`` says
        why): never saved over, for the missing bytes may yet be found."""
        if self._committed is None:
            self._reload()
        return self._damaged.get(step)

    def claimed_before(self, step: int) -> bool:
        """Whether ``step`` held a claim when this index first looked (True if it has not
        looked yet: nothing is proven then)."""
        return self._first_claims is None or step in self._first_claims

    def forget(self, step: int) -> None:
        if self._committed is not None:
            self._committed.pop(step, None)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every step directory, committed or partial, by step: one listing of the root."""
        if self._committed is None:
            return self._reload()
        files = step_files(self.store, include_temp=True)  # a crash may leave only temps
        manifests = {step for step, names in files.items() if MANIFEST_NAME in names}
        if manifests - set(self._committed) - set(self._newer) - set(self._damaged):
            return self._reload()  # someone else committed here: read it properly
        for known in (self._committed, self._newer, self._damaged):
            for gone in set(known) - manifests:
                del known[gone]
        by_step = {step: sum(names.values()) for step, names in files.items()}
        return [
            self._committed.get(step)
            or self._newer.get(step)
            or CheckpointInfo(
                step,
                False,
                nbytes,
                None,
                None,
                self.store.url_for(step_dir(step)),
                "no manifest (not committed)",
            )
            for step, nbytes in sorted(by_step.items())
        ]

    def _reload(self) -> list[CheckpointInfo]:
        files = step_files(self.store, include_temp=True)
        infos = list_checkpoints(self.store, files)
        if self._first_claims is None:
            self._first_claims = frozenset(s for s, names in files.items() if WRITER_NAME in names)
        self._committed = {c.step: c for c in infos if c.committed}
        self._newer = {c.step: c for c in infos if c.newer_format}
        self._damaged = {c.step: c for c in infos if c.damaged}
        return infos
