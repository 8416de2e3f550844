"""The reader fetches only what is asked for, in few ranged reads."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.checkpoint.format_util import load_from, publish, save_step, spy_reads
from unbroken import open_store
from unbroken.checkpoint.format.dcp_json import ItemLocation
from unbroken.checkpoint.format.read_plan import plan_windows

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


def test_a_payload_larger_than_a_window_is_split():
    locs = [loc(0, 64), loc(64, 2500), loc(2564, 64)]
    windows = plan_windows("f", locs, window_bytes=1000, merge_gap=1 << 20)
    assert [(w.start, w.end) for w in windows] == [
        (0, 64),
        (64, 1064),
        (1064, 2064),
        (2064, 2564),
        (2564, 2628),
    ]
    assert all(w.locations == (locs[1],) for w in windows[1:4])


@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 500)), max_size=40),
    st.integers(1, 3000),
    st.integers(0, 2000),
)
def test_windows_cover_every_payload_byte_once(gaps_and_lengths, window_bytes, gap):
    locs, offset = [], 0
    for skip, length in gaps_and_lengths:  # records in a file never overlap
        offset += skip
        locs.append(loc(offset, length))
        offset += length
    windows = plan_windows("f", locs, window_bytes=window_bytes, merge_gap=gap)
    assert {x for w in windows for x in w.locations} == set(locs)
    for w in windows:
        assert w.end - w.start <= window_bytes
    covered = {}
    for w in windows:
        for x in w.locations:
            a = max(x.payload_offset, w.start)
            b = min(x.payload_offset + x.payload_length, w.end)
            covered.setdefault(x, []).append((a, b))
    for x, parts in covered.items():
        parts.sort()
        assert parts[0][0] == x.payload_offset
        assert parts[-1][1] == x.payload_offset + x.payload_length
        assert all(p[1] == q[0] for p, q in itertools.pairwise(parts))
    assert [w.start for w in windows] == sorted(w.start for w in windows)


def test_split_payloads_are_reassembled(store, tmp_path, monkeypatch):
    import unbroken.checkpoint.format.read_plan as read_plan

    monkeypatch.setattr(read_plan, "WINDOW_BYTES", 10_000)  # every tensor spans many windows
    sd = {"big": torch.randn(100_003), "small": torch.arange(5.0), "k": {"x": 1}}
    directory, manifest = save_step(tmp_path / "stage", 2, sd)
    publish(directory, store, manifest)
    out = load_from(
        store, manifest, {"big": torch.zeros(100_003), "small": torch.zeros(5), "k": {"x": 0}}
    )
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])
    assert out["k"] == {"x": 1}


def test_loading_one_key_reads_only_its_bytes(tmp_path):
    sd = {f"w{i}": torch.randn(64 << 10) for i in range(16)}  # 16 x 256 KiB
    directory, manifest = save_step(tmp_path / "stage", 2, sd)
    # A remote: a local directory would be read straight into the tensor, not via read_bytes.
    store = open_store(f"emulated::{tmp_path / 'durable'}", latency=0.0, bandwidth=None)
    publish(directory, store, manifest)
    reads = spy_reads(store)
    out = load_from(store, manifest, {"w5": torch.zeros(64 << 10)})
    assert torch.equal(out["w5"], sd["w5"])
    shard_reads = [r for r in reads if r[0].endswith(".distcp")]
    assert len(shard_reads) == 1 and shard_reads[0][1] == sd["w5"].nbytes
    assert all(r[0].endswith(("metadata.json", ".distcp")) for r in reads)  # never .metadata


def test_flaky_remote_is_retried_by_the_store(tmp_path, monkeypatch):
    """A third of requests fail transiently: the store retries, the load still succeeds."""
    import unbroken.checkpoint.format.read_plan as read_plan
    from unbroken.storage import RetryPolicy

    monkeypatch.setattr(read_plan, "WINDOW_BYTES", 50_000)
    sd = {f"w{i}": torch.randn(20_000) for i in range(6)}
    directory, manifest = save_step(tmp_path / "stage", 2, sd)
    publish(directory, open_store(tmp_path / "durable"), manifest)
    flaky = open_store(
        f"emulated::{tmp_path / 'durable'}",
        retry=RetryPolicy(max_attempts=30, base_delay=0.001, max_delay=0.01),
        latency=0.0,
        bandwidth=None,
        fail_rate=0.33,
        seed=7,
    )
    out = load_from(flaky, manifest, {k: torch.zeros(20_000) for k in sd})
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert flaky.stats.retries > 0
