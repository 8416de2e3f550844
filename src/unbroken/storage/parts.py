"""Large objects move as parts: parallel ranged GETs into a file, multipart PUTs.

Memory stays bounded by streams x part size, whatever the object's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PART_SIZE = 8 << 20
"""Objects larger than this move as parallel parts of this size (S3's minimum is 5 MiB)."""
PART_STREAMS = 8
"""Parallel streams for one large download or multipart upload (memory: streams x part)."""


def part_ranges(offset: int, length: int, part_bytes: int = PART_SIZE) -> list[tuple[int, int]]:
    """[start, end) byte ranges of at most ``part_bytes`` covering [offset, offset+length)."""
    end = offset + length
    return [(a, min(end, a + part_bytes)) for a in range(offset, end, part_bytes)]


def download_in_parts(size: int, fetch: Callable[[int, int], Any], local_path: str) -> None:
    """Fill ``local_path`` with ``size`` bytes, ``fetch(start, end)`` giving each part.

    ``fetch`` returns a bytes-like object for [start, end); parts are written at their
    offsets as they land, PART_STREAMS at a time."""
    with open(local_path, "wb") as f:
        f.truncate(size)
        fd = f.fileno()

        def one(part: tuple[int, int]) -> None:
            offset, end = part
            data = memoryview(fetch(offset, end))
            if data.nbytes != end - offset:
                raise ConnectionError(f"part [{offset}, {end}) came back with {data.nbytes} bytes")
            written = 0
            while written < data.nbytes:
                written += os.pwrite(fd, data[written:], offset + written)

        with ThreadPoolExecutor(PART_STREAMS, thread_name_prefix="unbroken-get") as pool:
            list(pool.map(one, part_ranges(0, size)))
