"""What a loader delivered, checked against the source files (pure: no I/O, no peers).

Every row of ``bench/peers/loaders.py`` yields, with each sample, the key it claims to be and a
CRC-32 of the raw bytes it read. :func:`account` compares those deliveries with the
source's own CRCs: a key delivered twice is a duplicate, a key never delivered is
missing, bytes that are not the key's own are a mismatch (a peer's forked workers were
seen sharing one inherited connection and receiving another request's bytes).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


def crc_of(data: bytes) -> int:
    """The checksum every row reports with a sample: CRC-32 of the raw bytes read."""
    return zlib.crc32(data)


@dataclass(frozen=True)
class Accounting:
    """One pass (or a saved-then-resumed pass) against the source set."""

    delivered: int
    """Samples the loader handed to the training loop."""
    duplicates: int
    """Deliveries beyond the first of the same key."""
    missing: int
    """Source keys never delivered."""
    mismatched: int
    """Deliveries whose bytes were not their key's (CRC differs from the source's)."""
    unknown: int
    """Deliveries of a key the source does not have."""

    @property
    def exact(self) -> bool:
        """Every source sample once, with its own bytes."""
        return not (self.duplicates or self.missing or self.mismatched or self.unknown)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def account(delivered: Iterable[tuple[str, int]], source: Mapping[str, int]) -> Accounting:
    """Check ``(key, crc)`` deliveries against ``source`` (key -> crc of its bytes)."""
    counts: Counter[str] = Counter()
    mismatched = unknown = 0
    for key, crc in delivered:
        counts[key] += 1
        want = source.get(key)
        if want is None:
            unknown += 1
        elif int(crc) != want:
            mismatched += 1
    known = sum(1 for key in counts if key in source)
    missing = len(source) - known
    duplicates = sum(n - 1 for n in counts.values())
    return Accounting(sum(counts.values()), duplicates, missing, mismatched, unknown)


def delivered_of_batch(batch: Any) -> list[tuple[str, int]]:
    """``(key, crc)`` of each sample of a collated ``(images, crcs, keys)`` batch."""
    _images, crcs, keys = batch
    crcs = crcs.tolist() if hasattr(crcs, "tolist") else list(crcs)
    return list(zip(keys, (int(c) for c in crcs)))


CELL = 48
"""The widest a reason may be in the table."""


def resume_cell(result: Any, whole: bool = False) -> str:
    """The table's text for a resume measurement: its counts, or why there is none
    (cut to :data:`CELL` characters unless ``whole``; the JSON line keeps it all)."""
    if isinstance(result, str):
        return result if whole or len(result) <= CELL else result[: CELL - 3] + "..."
    if not result:
        return "-"
    acc = Accounting(**result)
    if acc.exact:
        return "exact"
    parts = [
        f"{n} {what}"
        for n, what in (
            (acc.duplicates, "dup"),
            (acc.missing, "missing"),
            (acc.mismatched, "bad bytes"),
            (acc.unknown, "unknown"),
        )
        if n
    ]
    return ", ".join(parts)
