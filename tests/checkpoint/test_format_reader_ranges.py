"""The reader fetches only what is asked for, in few ranged reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.checkpoint.format_util import load_from, publish, save_step
from unbroken import open_store
from unbroken.checkpoint.dcp_json import ItemLocation
from unbroken.checkpoint.reader import plan_windows

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def loc(offset: int, length: int) -> ItemLocation:
    return ItemLocation("f", offset, length, offset, length, 0)


def test_windows_merge_near_payloads_and_split_far_ones():
    locs = [loc(0, 100), loc(128, 100), loc(10_000, 50), loc(5_000_000, 10)]
    windows = plan_windows("f", locs, window_bytes=1 << 20, merge_gap=4096)
    assert [(w.start, w.end) for w in windows] == [
        (0, 228),
        (10_000, 10_050),
        (5_000_000, 5_000_010),
    ]
    assert windows[0].locations == (locs[0], locs[1])


def test_a_payload_larger_than_a_window_is_read_alone():
    locs = [loc(0, 64), loc(64, 10_000), loc(10_064, 64)]
    windows = plan_windows("f", locs, window_bytes=1000, merge_gap=1 << 20)
    assert [(w.start, w.end) for w in windows] == [(0, 64), (64, 10_064), (10_064, 10_128)]


@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 500)), max_size=40),
    st.integers(1, 3000),
    st.integers(0, 2000),
)
def test_windows_cover_every_payload_once(spans, window_bytes, gap):
    locs = [loc(o, n) for o, n in spans]
    windows = plan_windows("f", locs, window_bytes=window_bytes, merge_gap=gap)
    served = [x for w in windows for x in w.locations]
    assert set(served) == set(locs) and len(served) == len(set(locs))  # each payload once
    for w in windows:
        assert all(
            w.start <= x.payload_offset and x.payload_offset + x.payload_length <= w.end
            for x in w.locations
        )
        if len(w.locations) > 1:
            assert w.end - w.start <= window_bytes
    assert [w.start for w in windows] == sorted(w.start for w in windows)


def test_loading_one_key_reads_only_its_bytes(tmp_path):
    sd = {f"w{i}": torch.randn(64 << 10) for i in range(16)}  # 16 x 256 KiB
    directory, manifest = save_step(tmp_path / "stage", 2, sd)
    store = open_store(tmp_path / "durable")
    publish(directory, store, manifest)
    reads = []
    original = store.read_bytes

    def spy(key, start=None, end=None):
        data = original(key, start, end)
        reads.append((key, start, end, len(data)))
        return data

    store.read_bytes = spy
    out = load_from(store, manifest, {"w5": torch.zeros(64 << 10)})
    assert torch.equal(out["w5"], sd["w5"])
    shard_reads = [r for r in reads if r[0].endswith(".distcp")]
    assert len(shard_reads) == 1 and shard_reads[0][3] == sd["w5"].nbytes
    assert all(r[0].endswith(("metadata.json", ".distcp")) for r in reads)  # never .metadata
