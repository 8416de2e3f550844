"""A checkpoint state whose costly entries are built only when a save reads them.

``CheckpointManager.maybe_save`` reads its ``state`` only on a step that saves (a due
step, or the one after a preemption signal). A framework's state (Lightning's checkpoint
dict, the Trainer's bookkeeping) takes real time to build, so the integrations hand the
manager this mapping and call ``maybe_save`` every step at no cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


class LiveState(Mapping[str, Any]):
    """``fixed`` entries as they are, ``computed`` ones by calling their function on access."""

    def __init__(self, fixed: Mapping[str, Any], computed: Mapping[str, Callable[[], Any]]) -> None:
        both = set(fixed) & set(computed)
        if both:
            raise ValueError(f"LiveState: entries {sorted(both)} are both fixed and computed")
        self.fixed = dict(fixed)
        self.computed = dict(computed)

    def __getitem__(self, name: str) -> Any:
        if name in self.computed:
            return self.computed[name]()
        return self.fixed[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.fixed
        yield from self.computed

    def __len__(self) -> int:
        return len(self.fixed) + len(self.computed)
