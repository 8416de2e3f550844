"""The benchmark's rows on their own, where a row does something a table cannot show."""

from __future__ import annotations

import os

import pytest
import torch

from bench.checkpoint.rows import RowContext, TwoTierFloor, local_tensors


def _ctx(tmp_path) -> RowContext:
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    remote = tmp_path / "remote"
    remote.mkdir()
    return RowContext(model, optim, 0, 1, str(remote), str(tmp_path / "work"), {})


def _bytes(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def test_two_tier_floor_writes_the_state_to_both_disks_and_keeps_only_the_newest(tmp_path):
    ctx = _ctx(tmp_path)
    row = TwoTierFloor(ctx)
    for step in (1, 2, 3):
        row.save(step)
        row.drain()
        assert row.last_commit_seconds is not None and row.last_commit_seconds > 0
    want = _bytes(row.src)
    name = "step-000000003-rank0.bin"
    local = os.path.join(ctx.work_dir, "floor-2tier")
    assert os.listdir(local) == [name]  # a staging tier keeps its newest copy only
    assert sorted(os.listdir(ctx.row_dir)) == ["step-000000002-rank0.bin", name]
    for path in (os.path.join(local, name), os.path.join(ctx.row_dir, name)):
        with open(path, "rb") as f:
            assert f.read() == want
    assert row.restore_local() is None


def test_two_tier_floor_reports_a_failed_write_on_drain(tmp_path):
    ctx = _ctx(tmp_path)
    row = TwoTierFloor(ctx)
    os.rmdir(ctx.row_dir)  # the remote's directory is gone: its write fails
    row.save(1)
    with pytest.raises(RuntimeError, match="a write failed") as info:
        row.drain()
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_local_tensors_keep_their_order_when_a_restore_reinserts_the_optimizer_state():
    """A restore through set_optimizer_state_dict (unbroken's, on FSDP2 with 2 ranks) puts
    each parameter's Adam state back as {exp_avg, exp_avg_sq, step}, not in the order Adam
    made it: the benchmark's byte check compares by position, so it must not depend on it."""
    model = torch.nn.Linear(8, 4, bias=False)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    before = [t.clone() for t in local_tensors(model, optim)]
    for p in model.parameters():
        state = optim.state[p]
        optim.state[p] = {k: state[k] for k in reversed(list(state))}  # same values, reordered
    after = local_tensors(model, optim)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
