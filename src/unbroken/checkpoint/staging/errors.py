"""Errors raised while staging state into host buffers.

``CheckpointError`` is the root of every checkpoint error. It lives in
``unbroken.checkpoint.errors`` (owned by the format side); until that module is on this
branch, an equivalent root is defined here so the staging errors have a stable base.
"""

from __future__ import annotations

from collections.abc import Sequence

try:  # the shared root, once the format side's errors module is merged
    from unbroken.checkpoint.errors import CheckpointError
except ImportError:  # pragma: no cover - depends on merge order

    class CheckpointError(Exception):  # type: ignore[no-redef]
        """Root of every checkpoint error."""


def _some(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown if len(keys) <= limit else f"{shown} and {len(keys) - limit} more"


class TornSnapshotError(CheckpointError):
    """A source tensor changed in place before its copy finished: the snapshot is abandoned.

    ``keys`` names the tensors whose version counter moved between ``stage()`` and the end
    of their copy, or whose bytes no longer matched their copy once it ended (a write
    through ``.data``; that check stops at the first). Nothing was committed with mixed
    values.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        super().__init__(
            f"torn snapshot abandoned, nothing of it kept: written in place while the save "
            f"was copying them: {_some(self.keys)}. Write tensors outside the optimizer (an "
            "EMA, weight clipping, anything through .data) before save() or after the next "
            "optimizer.step(), not between the two; a tensor that forward changes in place "
            "must be a module buffer (register_buffer), which is copied before save() returns."
        )


class StagingBudgetError(CheckpointError):
    """The state needs more host buffer memory than the pool's ``max_bytes`` allows."""

    def __init__(self, needed: int, max_bytes: int, largest: Sequence[tuple[str, int]]) -> None:
        self.needed = needed
        self.max_bytes = max_bytes
        top = ", ".join(f"{k!r} ({n} B)" for k, n in largest)
        super().__init__(
            f"staging needs {needed} bytes of host buffers but max_bytes is {max_bytes}; "
            f"largest keys: {top}. Raise max_bytes or stage a smaller state."
        )


class StagingBusyError(CheckpointError):
    """The previous staged state still holds the buffers (not yet released)."""
