"""Comparing a finished copy with its sources: exact bytes, every slice, any layout.

The device comparison runs here on CPU tensors standing in for a device (no stream), so
its slicing and verdicts are checked without a GPU."""

from __future__ import annotations

import contextlib

import torch

from unbroken.checkpoint.staging.verify import (
    VERIFY_SLICE_BYTES,
    differing_on_device,
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


def test_device_comparison_names_exactly_the_sources_that_differ():
    sources = {
        "same": torch.randn(100),
        "last_slice": torch.randn(100),
        "strided": torch.arange(40.0).reshape(5, 8).t(),
        "first_byte": torch.arange(9, dtype=torch.int8),
        "tiny": torch.ones(1, dtype=torch.bool),
    }
    buffers = {name: _buffer(src) for name, src in sources.items()}
    sources["last_slice"][-1] = 7.0
    sources["strided"].data[0, 0] = -1.0
    sources["first_byte"][0] = 100
    pairs = [(name, src, buffers[name]) for name, src in sources.items()]
    stream = contextlib.nullcontext
    for slice_bytes in (64, 3, 1 << 20):
        got = differing_on_device(pairs, lambda _device: stream(), slice_bytes)
        assert got == ["last_slice", "strided", "first_byte"], slice_bytes
