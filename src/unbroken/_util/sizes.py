"""Human byte sizes ("200GB", "1.5 GiB") and durations, parsed in one place."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str | None) -> int | None:
    """Bytes from an int or a string such as ``"200GB"``; None stays None.

    Decimal units (KB, MB, GB) are powers of ten and binary ones (KiB, MiB, GiB)
    powers of two, as disks and links are sold.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative: {value!r}")
        return int(value)
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a byte size: {value!r} (use a number of bytes or e.g. '200GB', '512MiB')"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Short decimal rendering for tables and messages."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")
