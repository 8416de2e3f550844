"""The CUDA path, end to end: state on a GPU, staged on a side stream into pinned host
buffers, restored back onto the GPU (or onto the CPU of a machine without one).

Skipped without CUDA; `bench/checkpoint/gpu.py` and these run where a GPU is lent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unbroken as ub
from unbroken.checkpoint.staging.stager import StateStager

from .manager_util import make_state, rng_draws, snapshot, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

JOB = Path(__file__).with_name("memory_job.py")


def _tensors(state: dict) -> dict:
    return {k: v for k, v in snapshot(state).items() if isinstance(v, torch.Tensor)}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _on_cuda(state: dict) -> None:
    for name, t in _state_tensors(state):
        assert t.is_cuda, f"{name} restored onto {t.device}"


def _state_tensors(state: dict):
    yield from state["model"].state_dict().items()
    for pid, st in state["optim"].state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():  # Adam's step may stay on the CPU
                yield f"optim.{pid}.{k}", v
    yield "ema", state["ema"]


def test_buffers_of_cuda_sources_are_pinned_and_the_copy_is_exact():
    stager = StateStager()
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.arange(7, device="cuda")}
    try:
        with stager.stage(state) as staged:
            staged.wait()
            for key, buf in staged.state_dict.items():
                assert buf.device.type == "cpu" and buf.is_pinned(), key
                assert torch.equal(buf, state[key].cpu()), key
    finally:
        stager.close()


def test_saves_of_cuda_state_overlap_training_and_restore_bitwise(tmp_path):
    state = make_state(0, device="cuda")
    mgr = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "s", every_steps=3)
    saved = {}
    for step in range(1, 11):
        train(state, range(step, step + 1))
        if mgr.maybe_save(step, state):
            # what the save must hold: the state as of now, while the copy still runs
            saved[step] = _tensors(state)
    mgr.wait()
    # from the second save on, CUDA sources copy into the memory tier's page-locked arenas
    assert mgr.stats.bytes_staged_in_place > 0
    mgr.close()
    last = max(saved)
    assert [c.step for c in mgr.checkpoints() if c.committed] == sorted(saved)[-3:]

    again = make_state(1, lr=0.9, device="cuda")
    other = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "s2")
    try:
        assert other.restore(again) == last
        _same(_tensors(again), saved[last])
        _on_cuda(again)
    finally:
        other.close()

    on_cpu = make_state(2, lr=0.9)  # a machine without a GPU reads a GPU job's checkpoint
    cpu = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "s3")
    try:
        assert cpu.restore(on_cpu) == last
        _same(_tensors(on_cpu), saved[last])
    finally:
        cpu.close()


def test_an_ema_written_through_data_while_its_copy_runs_is_never_torn(tmp_path):
    """``p.data.mul_`` bumps no version counter: the save still holds one state or none."""
    state = make_state(0, device="cuda")
    big = torch.zeros(1 << 24, device="cuda")
    state["big"] = big
    mgr = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "s")
    try:
        for step in range(1, 4):
            big.data.fill_(float(step))
            mgr.save(step, state)
            big.data.fill_(float(step) + 0.5)  # on the training stream, beside the copy
            try:
                mgr.wait()
            except ub.CheckpointError:
                continue  # abandoned and reported: allowed
        assert mgr.stats.committed + mgr.stats.failed == 3, mgr.stats  # each save accounted
        for info in mgr.checkpoints():
            if not info.committed:
                continue
            probe = {"big": torch.empty(1 << 24, device="cuda")}
            reader = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "r")
            try:
                reader.restore(probe, step=info.step)
            finally:
                reader.close()
            values = probe["big"].unique().tolist()
            assert len(values) == 1 and values[0] in (info.step, info.step + 0.5), values
    finally:
        mgr.close()


def test_a_cuda_job_killed_after_its_commit_restores_from_memory_bitwise(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "UNBROKEN_TEST_DEVICE": "cuda"}
    cmd = [sys.executable, str(JOB), str(tmp_path / "durable"), str(tmp_path / "s"), str(out)]
    proc = subprocess.run([*cmd, "kill"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    state = make_state(1, lr=0.9, device="cuda")
    mgr = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "s", every_steps=2)
    try:
        assert mgr.restore(state) == 4
        assert mgr.last_restore.tier == "memory", mgr.last_restore
        _same(_tensors(state), torch.load(out / "expected.pt", weights_only=True))
        _on_cuda(state)
        assert rng_draws(cuda=True) == json.loads((out / "draws.json").read_text())
    finally:
        mgr.close()
