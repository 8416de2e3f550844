"""The loader's saved position: its format, and what a state must hold to resume here.

A position only means something over the same files in the same order: a state from
another file set, seed or order is refused by name, never resumed at a wrong place.
"""

from __future__ import annotations

from typing import Any

from unbroken.data.dataset import VolumeDataset

STATE_FORMAT = 1
MAX_EPOCH = 2**62
"""The largest epoch (or count) a state may hold: far past any run, within the int64 plan."""
_STATE_KEYS = ("format", "epoch", "position", "seed", "shuffle", "num_samples", "fingerprint")


class LoaderStateError(ValueError):
    """A saved loader state does not fit this loader (another volume, seed, ...)."""


def check_state(state: Any, ds: VolumeDataset) -> None:
    """Raise LoaderStateError, naming the problem, unless ``state`` is a position in
    ``ds`` as it is now (the same files, seed and order)."""
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise LoaderStateError(f"unbroken.DataLoader: loader state lacks {missing}")
    if not _is_int(state["format"]) or state["format"] != STATE_FORMAT:
        raise LoaderStateError(f"unbroken.DataLoader: unknown state format {state['format']!r}")
    for key in ("epoch", "position", "num_samples"):
        if not _is_int(state[key]) or not 0 <= state[key] <= MAX_EPOCH:
            raise LoaderStateError(f"unbroken.DataLoader: bad {key} {state[key]!r} in state")
    if state["fingerprint"] != ds.fingerprint:
        raise LoaderStateError(
            f"unbroken.DataLoader: the saved position belongs to another file set: "
            f"saved index fingerprint {state['fingerprint']} ({state['num_samples']} "
            f"files), the volume {ds.url} now has {ds.fingerprint} ({len(ds)} files). "
            "Files were added, deleted or rewritten since, or the include/exclude "
            "patterns differ. Restore the files to resume here (on a path, with a copy "
            "that keeps their mtimes: cp -a), or start the data position afresh (do not "
            "load this state)"
        )
    if state["num_samples"] != len(ds):  # the same files: the state contradicts itself
        raise LoaderStateError(
            f"unbroken.DataLoader: bad num_samples {state['num_samples']} in state: its "
            f"fingerprint is that of {ds.url}, which has {len(ds)} files"
        )
    for key, mine in (("seed", ds.seed), ("shuffle", ds.shuffle)):
        if type(state[key]) is not type(mine) or state[key] != mine:
            raise LoaderStateError(
                f"unbroken.DataLoader: saved {key}={state[key]!r} but this dataset has "
                f"{key}={mine!r}; the saved position only means something in the saved order"
            )
    if state["position"] > len(ds):
        raise LoaderStateError(
            f"unbroken.DataLoader: position {state['position']} is past the {len(ds)} files"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
