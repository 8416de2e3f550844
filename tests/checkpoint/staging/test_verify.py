"""Comparing a finished copy with its sources: exact bytes, every slice, any layout.

The device fingerprints run here on CPU tensors standing in for a device, so their
slicing and verdicts are checked without a GPU."""

from __future__ import annotations

import torch

from unbroken.checkpoint.staging.verify import (
    VERIFY_SLICE_BYTES,
    changed_on_device,
    device_fingerprints,
    same_bytes_cpu,
    source_bytes,
)


def _buffer(src: torch.Tensor) -> torch.Tensor:
    """What staging makes of a source: a contiguous copy of its values."""
    dst = torch.empty(src.shape, dtype=src.dtype)
    dst.copy_(src)
    return dst


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _never() -> bool:
    return False


def test_source_bytes_are_laid_out_like_the_buffer_for_any_layout():
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    for src in (
        base,
        base.t(),
        base[2:4],
        torch.randn(4, dtype=torch.complex64).conj(),
        torch.zeros(1).expand(5),
        torch.randn(3, 2).to(torch.bfloat16),
    ):
        assert torch.equal(source_bytes(src), _flat(_buffer(src)))


def test_cpu_comparison_finds_a_change_in_any_slice_and_nan_is_equal_to_itself():
    src = torch.randn(VERIFY_SLICE_BYTES // 4 + 10)  # two slices
    src[3] = float("nan")
    dst = _buffer(src)
    assert same_bytes_cpu(source_bytes(src), _flat(dst), _never)
    src.data[-1] += 1.0  # in the second slice, through .data
    assert not same_bytes_cpu(source_bytes(src), _flat(dst), _never)
    assert same_bytes_cpu(source_bytes(src), _flat(dst), lambda: True)  # aborted: no verdict


def _prints(values: dict, slice_bytes: int) -> torch.Tensor:
    return device_fingerprints(list(values.values()), slice_bytes)


def test_device_fingerprints_name_exactly_the_sources_written_during_the_copy():
    sources = {
        "same": torch.randn(100),
        "last_slice": torch.randn(100),
        "strided": torch.arange(40.0).reshape(5, 8).t(),
        "first_byte": torch.arange(9, dtype=torch.int8),
        "swapped": torch.arange(64, dtype=torch.float32),
        "odd_length": torch.randn(7, dtype=torch.float16),
        "tiny": torch.ones(1, dtype=torch.bool),
    }
    names = list(sources)
    for slice_bytes in (64, 3, 8, 1 << 20):
        values = {name: src.clone() for name, src in sources.items()}
        before = _prints(values, slice_bytes)
        assert changed_on_device(names, before, _prints(values, slice_bytes)) == []
        values["last_slice"].data[-1] += 1.0  # through .data: no version moves
        values["strided"].data[0, 0] = -1.0
        values["first_byte"][0] = 100
        values["swapped"][[3, 40]] = values["swapped"][[40, 3]]  # the plain sum stays
        values["odd_length"][6] = 0.5
        got = changed_on_device(names, before, _prints(values, slice_bytes))
        assert got == ["last_slice", "strided", "first_byte", "swapped", "odd_length"]


def test_fingerprints_do_not_depend_on_the_slicing():
    src = torch.randn(1000)
    ref = device_fingerprints([src], 1 << 20)
    for slice_bytes in (8, 24, 4000, 4096):
        assert torch.equal(device_fingerprints([src], slice_bytes), ref), slice_bytes
