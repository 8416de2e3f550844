"""crc32c_combine: the file checksum from its parts' checksums (pure arithmetic)."""

from __future__ import annotations

import os
import random

import crc32c
import pytest

from unbroken._util.crc32c_combine import crc32c_combine


def test_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(7)
    for _ in range(300):
        a = os.urandom(rng.choice([0, 1, 3, 64, rng.randint(0, 5000)]))
        b = os.urandom(rng.choice([0, 1, 7, 4096, rng.randint(0, 5000)]))
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combine_folds_many_parts_in_order():
    parts = [os.urandom(n) for n in (10, 0, 4093, 1 << 16, 5)]
    crc = 0
    for p in parts:
        crc = crc32c_combine(crc, crc32c.crc32c(p), len(p))
    assert crc == crc32c.crc32c(b"".join(parts))


def test_negative_length_is_refused():
    with pytest.raises(ValueError, match="negative length"):
        crc32c_combine(1, 2, -1)
