"""HostBufferPool: reuse per key, bounded by max_bytes, realloc only on a changed spec."""

from __future__ import annotations

import pytest
import torch

from unbroken.checkpoint.host_buffers import BufferSpec, HostBufferPool
from unbroken.checkpoint.staging_errors import CheckpointError, StagingBudgetError


def test_same_specs_reuse_the_same_buffers():
    pool = HostBufferPool()
    specs = {"a": BufferSpec((4, 5), torch.float32), "b": BufferSpec((3,), torch.int64)}
    first, allocated = pool.reserve(specs)
    assert allocated == 4 * 5 * 4 + 3 * 8
    for _ in range(5):
        again, allocated = pool.reserve(dict(specs))
        assert allocated == 0
        assert {k: v.data_ptr() for k, v in again.items()} == {
            k: v.data_ptr() for k, v in first.items()
        }
    assert pool.allocations == 2
    assert first["a"].shape == (4, 5) and first["a"].dtype == torch.float32
    assert first["a"].is_contiguous() and first["a"].is_shared()


def test_changed_dtype_or_shape_reallocates_that_key_only():
    pool = HostBufferPool()
    a0 = pool.reserve({"a": BufferSpec((8,), torch.float32), "b": BufferSpec((8,), torch.float32)})[
        0
    ]
    a1, allocated = pool.reserve(
        {"a": BufferSpec((8,), torch.bfloat16), "b": BufferSpec((8,), torch.float32)}
    )
    assert allocated == 16
    assert a1["a"].dtype == torch.bfloat16
    assert a1["b"].data_ptr() == a0["b"].data_ptr()
    assert pool.nbytes == 16 + 32 and len(pool) == 2


def test_budget_boundary_and_refusal_changes_nothing():
    pool = HostBufferPool(max_bytes=64)
    pool.reserve({"a": BufferSpec((16,), torch.float32)})  # exactly 64 bytes: allowed
    with pytest.raises(StagingBudgetError, match=r"needs 68 bytes.*max_bytes is 64") as info:
        pool.reserve({"a": BufferSpec((16,), torch.float32), "b": BufferSpec((1,), torch.int32)})
    assert isinstance(info.value, CheckpointError)
    assert "a" in pool and "b" not in pool and pool.nbytes == 64


def test_empty_and_scalar_buffers_and_plain_memory():
    pool = HostBufferPool(shared_memory=False)
    out, _ = pool.reserve({"e": BufferSpec((0, 3), torch.float32), "s": BufferSpec((), torch.int8)})
    assert out["e"].shape == (0, 3) and out["s"].shape == ()
    assert not out["s"].is_shared()
    pool.clear()
    assert len(pool) == 0 and pool.nbytes == 0
