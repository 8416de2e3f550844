"""part_ranges: the one splitter behind ranged downloads and restores into targets."""

from unbroken.storage.parts import PART_SIZE, part_ranges


def test_ranges_cover_the_span_exactly_with_a_short_last_part():
    assert part_ranges(10, 25, 10) == [(10, 20), (20, 30), (30, 35)]
    assert part_ranges(0, 20, 10) == [(0, 10), (10, 20)]
    assert part_ranges(5, 0, 10) == []
    assert part_ranges(0, PART_SIZE + 1) == [(0, PART_SIZE), (PART_SIZE, PART_SIZE + 1)]
