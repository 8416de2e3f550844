"""bench/data.py's table: the compared columns by default, every one with --all-columns."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

import data


def _epoch(images: int, rate: float, cpu_ms: float) -> data.Epoch:
    epoch = object.__new__(data.Epoch)  # the figures of a pass, without running one
    epoch.images, epoch.seconds, epoch.first_batch = images, images / rate + 1.0, 1.0
    epoch.rate, epoch.cpu_ms = rate, cpu_ms
    return epoch


def test_default_table_shows_rate_ratio_and_cpu_and_all_columns_the_rest():
    rows = {
        "stock remote": _epoch(576, 50.0, 3.0),
        "unbroken e1": _epoch(576, 400.0, 2.5),
        "unbroken e2": _epoch(576, 800.0, 2.0),
        "stock local": _epoch(576, 850.0, 1.9),
    }
    labels = {k: k for k in rows}
    short = data.table(rows, labels, {"unbroken e1": "57.2 -> 417 (7.3x)"}, False)
    full = data.table(rows, labels, {"unbroken e1": "57.2 -> 417 (7.3x)"}, True)
    head = short.splitlines()[0]
    assert all(title in head for title in data.MAIN_COLUMNS)
    assert "first batch s" not in head and "7.3x" not in short
    e1 = next(line for line in short.splitlines() if line.startswith("unbroken e1"))
    assert e1.split()[2:] == ["400.0", "8.0x", "2.50"]
    assert "first batch s" in full and "(7.3x)" in full and "576" in full
