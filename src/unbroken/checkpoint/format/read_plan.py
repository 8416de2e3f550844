"""Which byte ranges of a shard file one rank reads (pure): few ranged reads, bounded.

A rank needs only some payloads of each shard file (resharding N ranks onto M); reading
each payload alone costs a request apiece, reading the file whole wastes bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.checkpoint.format.dcp_json import ItemLocation

WINDOW_BYTES = 64 << 20
"""Most bytes one ranged read fetches (a larger single payload is read alone)."""
MERGE_GAP = 1 << 20
"""Payloads closer than this are fetched in one ranged read (the gap is read and dropped)."""
IN_FLIGHT = 4
"""Windows fetched concurrently. Memory: about (IN_FLIGHT + 1) * WINDOW_BYTES of windows,
plus the one large payload being assembled."""

PART_BYTES = 16 << 20
"""A payload read from a remote store straight into its target tensor comes in ranged
reads of this size: large enough that a request's own cost is small beside its bytes,
small enough to spread one large tensor over ``PARTS_IN_FLIGHT`` connections."""
PARTS_IN_FLIGHT = 8
"""Ranged reads into targets running at once (memory: this many parts in flight)."""


@dataclass(frozen=True)
class Window:
    """One ranged read [start, end) of a shard file and the payloads it (partly) holds."""

    file: str
    start: int
    end: int
    locations: tuple[ItemLocation, ...]


def plan_windows(
    file: str,
    locations: list[ItemLocation],
    *,
    window_bytes: int | None = None,
    merge_gap: int | None = None,
) -> list[Window]:
    """Cover one file's payloads with few ranged reads of at most ``window_bytes`` (pure).

    Nearby small payloads share a read; a payload larger than a window is split over
    consecutive windows (fetched in parallel, assembled by the reader). Sorted by offset.
    The defaults are read at call time, so a test can shrink them module-wide.
    """
    window_bytes = WINDOW_BYTES if window_bytes is None else window_bytes
    merge_gap = MERGE_GAP if merge_gap is None else merge_gap
    windows: list[Window] = []
    group: list[ItemLocation] = []
    start = end = 0
    for loc in sorted(set(locations), key=lambda x: (x.payload_offset, x.payload_length)):
        lo, hi = loc.payload_offset, loc.payload_offset + loc.payload_length
        if group and lo - end <= merge_gap and max(end, hi) - start <= window_bytes:
            group.append(loc)
            end = max(end, hi)
            continue
        if group:
            windows.append(Window(file, start, end, tuple(group)))
        if hi - lo > window_bytes:
            windows.extend(
                Window(file, a, min(hi, a + window_bytes), (loc,))
                for a in range(lo, hi, window_bytes)
            )
            group = []
            continue
        group, start, end = [loc], lo, hi
    if group:
        windows.append(Window(file, start, end, tuple(group)))
    return windows
