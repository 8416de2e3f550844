"""Staging into reused host buffers: exact copies, reuse, overlap with training, tearing."""

from __future__ import annotations

import gc
import os
import select
import sys
import threading
import time
from pathlib import Path

import crc32c
import psutil
import pytest
import torch

from unbroken.checkpoint.format.tensor_record import raw_view
from unbroken.checkpoint.staging import step_gate
from unbroken.checkpoint.staging.copy import CHECKSUM_SLICE_BYTES, buffer_key
from unbroken.checkpoint.staging.stager import (
    CheckpointError,
    StagingBudgetError,
    StagingBusyError,
    StateStager,
    TornSnapshotError,
    buffer_keys,
)

from ..distributed import check, torchrun
from ..manager_util import host_rss


def _model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 4)
    )


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    opt.zero_grad()
    model(torch.randn(16, width)).sum().backward()
    opt.step()


def _snapshot(state):
    """A plain deep copy of the state, to compare staged values with."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_snapshot(v) for v in state)
    return state


def _assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


@pytest.fixture
def stager():
    s = StateStager(chunk_bytes=64 * 1024)
    yield s
    s.close()


def test_values_copied_exactly_for_every_dtype_and_layout(stager):
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    state = {
        "f32": torch.randn(300, 200),  # larger than a chunk: copied in pieces
        "bf16": torch.randn(17, 3).to(torch.bfloat16),
        "i64": torch.arange(-5, 5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "strided": base.t(),  # not contiguous
        "view": base[2:4],  # storage offset
        "c128": torch.randn(5, dtype=torch.complex128),  # no integer type of 16 bytes
        "conj": torch.randn(4, dtype=torch.complex64).conj(),  # a lazily conjugated view
        "f16_strided": torch.randn(4, 6).half()[:, ::2],
        "nested": {"list": [torch.ones(3), 2, "x"], "tuple": (torch.zeros(2), None)},
        "step": 1200,
        "meta": {"lr": [0.1, 0.01], "name": "adamw"},
    }
    expected = _snapshot(state)
    with stager.stage(state) as staged:
        staged.wait()
        assert staged.done
        _assert_same(expected, staged.state_dict)
        for key in ("f32", "bf16", "strided", "view"):
            assert staged.state_dict[key].data_ptr() != state[key].data_ptr(), key
        assert staged.stats["bytes_copied"] == staged.stats["bytes"]


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_the_copy_leaves_the_default_of_later_threads_alone(copy_threads):
    """torch.set_num_threads in one thread also sets the default of threads started later
    (a data loader's, the user's): the copy must not leave its own setting there."""
    default = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        stager = StateStager(copy_threads=copy_threads)
        with stager.stage({"f32": torch.randn(300, 200), "v": torch.randn(6, 4).t()}) as staged:
            staged.wait()
        stager.close()
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [3] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(default)


def test_the_background_copy_checksums_each_buffer_it_copies(stager):
    """The local write reuses these instead of reading the buffers again, so each must be
    the crc32c of the buffer's bytes exactly: across slices, for strided sources, empty
    and 0-d tensors, and any dtype. Keys copied on the training thread have none."""
    state = {
        "big": torch.randn(CHECKSUM_SLICE_BYTES // 4 * 2 + 1000),  # three slices
        "chunked": torch.randn(300, 200),  # more than a chunk, less than a slice
        "bf16": torch.randn(17, 3).to(torch.bfloat16),
        "strided": torch.arange(60, dtype=torch.float64).reshape(6, 10).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "bn": torch.ones(5),
    }
    with stager.stage(state, first=["bn"]) as staged:
        assert staged.checksums == {}  # nothing is vouched for before wait()
        staged.wait()
        sums = staged.checksums
        for key, value in staged.state_dict.items():
            raw = raw_view(value)
            got = sums.get(buffer_key(value.data_ptr(), raw.nbytes))
            if key == "bn":
                assert got is None
            else:
                assert got == crc32c.crc32c(memoryview(raw)), key
        assert len(sums) == len(state) - 1
        with pytest.raises(TypeError):  # the writer's to read, nobody's to change
            sums[next(iter(sums))] = 0
    assert staged.checksums == {}  # released: the buffers are the next save's


def test_a_torn_snapshot_vouches_for_no_checksum():
    stager = StateStager(chunk_bytes=4096)
    state = _slow_copy_state()
    state["z.last"] = torch.zeros(4)
    staged = stager.stage(state)
    state["z.last"].add_(1.0)
    with pytest.raises(TornSnapshotError):
        staged.wait()
    assert staged.checksums == {}
    staged.release()
    stager.close()


def test_checksums_can_be_turned_off():
    stager = StateStager(checksum=False)
    with stager.stage({"w": torch.ones(1000)}) as staged:
        staged.wait()
        assert staged.checksums == {}
    stager.close()


def test_non_tensor_values_are_deep_copied_at_stage_time(stager):
    groups = [{"lr": 0.1, "params": [0, 1]}]
    state = {"w": torch.ones(4), "optim": {"param_groups": groups}}
    with stager.stage(state) as staged:
        groups[0]["lr"] = 0.5
        groups[0]["params"].append(2)
        staged.wait()
        assert staged.state_dict["optim"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]


def test_buffers_are_reused_across_saves(stager):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, 64)
    ptrs = None
    for _ in range(3):
        _train_step(model, opt, 64)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        with stager.stage(state) as staged:
            staged.wait()
            now = {k: v.data_ptr() for k, v in staged.state_dict["model"].items()}
            _assert_same(_snapshot(state), staged.state_dict)
            if ptrs is None:
                ptrs, allocations = now, stager.pool.allocations
                assert staged.stats["allocated_bytes"] == stager.pool.nbytes
                assert stager.pool.nbytes >= staged.stats["bytes"]  # + small buffers' slots
            else:
                assert now == ptrs
                assert staged.stats["allocated_bytes"] == 0
    assert stager.pool.allocations == allocations


def test_only_a_changed_key_is_reallocated_and_dropped_keys_are_freed(stager):
    # A page or more each, but c: buffers of their own (c is in the small-buffer segment)
    state = {"a": torch.ones(2048), "b": torch.ones(2048), "c": torch.ones(5)}
    with stager.stage(state) as staged:
        ptr_a = staged.state_dict["a"].data_ptr()
    state = {"a": torch.ones(2048), "b": torch.ones(32, 100)}  # b changes shape, c goes
    with stager.stage(state) as staged:
        staged.wait()
        assert staged.state_dict["a"].data_ptr() == ptr_a
        assert staged.stats["allocated_bytes"] == 3200 * 4
    assert "c" not in stager.pool
    assert stager.pool.nbytes == (2048 + 3200) * 4


def test_a_tensor_that_dcp_pickles_is_staged_into_a_storage_of_its_own(stager):
    """A tuple is one DCP item, saved with torch.save, which writes a view's whole
    storage: its tensors must not be views of the small buffers' segment."""
    scalars = {f"s{i}": torch.tensor(float(i)) for i in range(500)}
    tied = torch.tensor([7, 8])
    state = {"pos": (torch.tensor([3, 4]), "epoch"), "nested": [("a", tied)], "tied": tied}
    with stager.stage({**scalars, **state}) as staged:
        staged.wait()
        sd = staged.state_dict
        assert sd["pos"][0].tolist() == [3, 4] and sd["pos"][1] == "epoch"
        assert sd["pos"][0].untyped_storage().nbytes() == 16
        # Tied to a plain entry: the one buffer both share is a storage of its own too.
        assert sd["nested"][0][1].untyped_storage().nbytes() == 16
        assert sd["tied"].data_ptr() == sd["nested"][0][1].data_ptr()
        assert sd["s1"].untyped_storage().nbytes() >= 500 * 4  # the rest share a segment


def test_tied_tensors_share_one_buffer(stager):
    weight = torch.randn(8, 8)
    state = {"embed.weight": weight, "head.weight": weight}
    with stager.stage(state) as staged:
        staged.wait()
        sd = staged.state_dict
        assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
        assert torch.equal(sd["head.weight"], weight)
        assert staged.stats["bytes"] == weight.numel() * 4


def test_cpu_buffers_are_shared_memory_unless_disabled():
    for shared in (True, False):
        stager = StateStager(shared_memory=shared)
        with stager.stage({"w": torch.randn(64)}) as staged:
            staged.wait()
            assert staged.state_dict["w"].is_shared() is shared
        stager.close()


def test_rss_does_not_grow_over_20_stages(stager):
    state = {
        "model": {f"layer{i}.weight": torch.randn(256, 1024) for i in range(8)},  # 8 MB
        "optim": {"state": {i: {"exp_avg": torch.randn(256, 1024)} for i in range(8)}},
    }
    nbytes = 16 * 2**20
    proc = psutil.Process()
    with stager.stage(state) as staged:
        staged.wait()
    gc.collect()
    rss0 = proc.memory_info().rss
    for i in range(20):
        for t in state["model"].values():
            t.add_(1.0)  # training moves on between saves
        with stager.stage(state) as staged:
            staged.wait()
            assert staged.stats["allocated_bytes"] == 0
            assert torch.equal(
                staged.state_dict["model"]["layer0.weight"], state["model"]["layer0.weight"]
            ), i
        assert staged.state_dict == {}  # released: it no longer hands out the pool's buffers
    gc.collect()
    growth = proc.memory_info().rss - rss0
    # 20 fresh copies would add 20 * 16 MB; reuse keeps growth well under one copy.
    assert growth < nbytes // 2, (growth, nbytes)
    assert stager.pool.nbytes == nbytes


@pytest.mark.parametrize("shared", [False, True])
def test_close_returns_the_buffers_while_the_stager_is_still_referenced(shared):
    # A trainer keeps its manager as an attribute after close(): the pool must not
    # stay resident until that object happens to be collected.
    nbytes = 32 * 2**20
    stager = StateStager(shared_memory=shared)
    state = {"w": torch.ones(nbytes // 4)}
    before = host_rss()
    with stager.stage(state) as staged:
        staged.wait()
    del staged
    assert host_rss() - before >= nbytes // 2
    stager.close()
    assert host_rss() - before < nbytes // 8
    assert stager.pool.nbytes == 0


def test_training_overlaps_the_copy_and_the_snapshot_is_the_state_at_stage_time():
    width = 1024
    model = _model(width)
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, width)
    stager = StateStager(chunk_bytes=256 * 1024)  # many chunks: the copy takes a while
    assert step_gate.open_stagers() >= 1
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    expected = _snapshot(state)
    staged = stager.stage(state, first=buffer_keys(model, "model"))
    assert staged.stats["bytes_first"] < staged.stats["bytes"]
    # Training continues at once: forward/backward overlap the copy, step waits for it.
    assert step_gate.copies_in_flight() == 1
    _train_step(model, opt, width)
    assert staged.done  # the step pre-hook waited for the copy
    assert step_gate.copies_in_flight() == 0  # later steps do not wait for anything
    for _ in range(3):
        _train_step(model, opt, width)
    staged.wait()
    _assert_same(expected, staged.state_dict)
    changed = model.state_dict()["0.weight"]
    assert not torch.equal(changed, staged.state_dict["model"]["0.weight"])
    stats = staged.stats
    assert stats["blocking_seconds"] == stats["stage_seconds"] + stats["hook_wait_seconds"]
    staged.release()
    stager.close()
    assert len(opt._optimizer_step_pre_hooks) == 0  # one global hook, none of its own


def test_first_keys_are_copied_before_stage_returns(stager):
    model = _model()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, 64)
    big = {f"pad{i}": torch.randn(512, 512) for i in range(8)}  # keeps the copy busy
    state = {**big, "model": model.state_dict()}
    expected = _snapshot(state)
    first = buffer_keys(model, "model")
    assert "model.1.running_mean" in first
    staged = stager.stage(state, first=first)
    assert staged.stats["bytes_first"] == sum(b.numel() * b.element_size() for b in model.buffers())
    model(torch.randn(16, 64))  # forward mutates running_mean/var while the copy runs
    staged.wait()  # not torn: BatchNorm buffers were copied before stage() returned
    _assert_same(expected, staged.state_dict)
    assert not torch.equal(
        model.state_dict()["1.running_mean"], expected["model"]["1.running_mean"]
    )
    staged.release()


def test_first_accepts_a_prefix_and_rejects_unknown_keys(stager):
    state = {"model": {"bn.running_mean": torch.ones(3), "fc.weight": torch.ones(2)}}
    with stager.stage(state, first=["model.bn"]) as staged:
        assert staged.stats["bytes_first"] == 12
    with pytest.raises(ValueError, match=r"model\.bn\.running_var"):
        stager.stage(state, first=["model.bn.running_var"])


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_first_accepts_tensors_and_buffer_keys_sees_through_wrappers(stager):
    model = _model()
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    expected = ["model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"]
    assert buffer_keys(model, "model") == expected
    assert buffer_keys(torch.compile(model), "model") == expected
    assert buffer_keys(model) == [k[len("model.") :] for k in expected]

    state = {"model": torch.compile(model).state_dict(), "w": torch.ones(100)}
    assert "_orig_mod.1.running_mean" in state["model"]  # renamed: names would not match
    with stager.stage(state, first=list(model.buffers())) as staged:
        # the non-persistent buffer matches no key and is skipped; the others are first
        bn = model[1]
        assert staged.stats["bytes_first"] == sum(
            t.numel() * t.element_size()
            for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
        )
    with pytest.raises(TypeError, match="keys or tensors"):
        stager.stage(state, first=[3])


def _slow_copy_state() -> dict[str, torch.Tensor]:
    """32 MB that a stager with 4 KB chunks copies in 8192 steps, each needing the GIL
    back: a write issued right after stage() lands long before the copy ends, even when
    the machine is loaded."""
    return {f"pad{i:02d}": torch.randn(256, 1024) for i in range(32)}


def test_in_place_change_during_the_copy_tears_and_is_reported():
    stager = StateStager(chunk_bytes=4096)
    big = _slow_copy_state()
    big["z.last"] = torch.zeros(4)  # copied last
    staged = stager.stage(big)
    big["z.last"].add_(1.0)  # something else writes a source before its copy finished
    with pytest.raises(TornSnapshotError) as info:
        staged.wait()
    assert info.value.keys == ["z.last"]
    assert "'z.last'" in str(info.value) and ".data" in str(info.value)
    staged.release()
    # The stager is usable again; a clean snapshot follows.
    with stager.stage(big) as again:
        again.wait()
        _assert_same(big, again.state_dict)
    stager.close()


def test_a_write_racing_the_copy_of_the_same_tensor_is_reported():
    """torch bumps ``_version`` only after an in-place op wrote its data: a copy running
    alongside reads new data under the old version. The verdict is sealed after the
    write returned (in wait()), so the snapshot is reported torn, never kept mixed."""
    stager = StateStager(chunk_bytes=2**20)
    for _ in range(3):
        state = {"w": torch.zeros(16 * 2**20)}  # 64 MB: the add_ and the copy overlap
        staged = stager.stage(state)
        state["w"].add_(1.0)
        with pytest.raises(TornSnapshotError, match="'w'"):
            staged.wait()
        staged.release()
    stager.close()


def test_an_optimizer_the_state_does_not_hold_waits_for_the_copy():
    """The step hook is global: an optimizer no one handed to the stager (a model-only
    state) still waits, so its step cannot tear the snapshot."""
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    stager = StateStager(chunk_bytes=4096)
    state = {**_slow_copy_state(), "model": model.state_dict()}  # model copied last
    expected = _snapshot(state)
    staged = stager.stage(state)
    opt.step()  # right away: the copy of 32 MB in 4 KB chunks has only just begun
    assert staged.done
    staged.wait()
    _assert_same(expected, staged.state_dict)
    assert not torch.equal(model.weight, expected["model"]["weight"])
    staged.release()
    stager.close()


def test_a_step_waits_for_nothing_once_the_copy_is_sealed(stager):
    """A saved state whose copy is done but whose buffers are still being written out
    holds no step back: the hook only waits while a copy is in flight."""
    opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    staged = stager.stage({"w": torch.ones(1000)})
    staged.wait()
    assert stager.busy and step_gate.copies_in_flight() == 0
    opt.step()
    assert staged.stats["hook_wait_seconds"] == 0.0
    staged.release()


def _copied(staged) -> int:
    return int(staged.stats["bytes_copied"])


def test_a_write_through_data_after_its_copy_is_reported_never_kept_mixed():
    """``.data`` writes do not move ``_version``. Written after its copy, before the copy
    of the rest ended: the first tensor's buffer holds the old value, the last one's the
    new; the comparison once the copy ends abandons the snapshot and names the first."""
    stager = StateStager(chunk_bytes=4096)
    state = {"a.first": torch.zeros(2**20), **_slow_copy_state(), "z.last": torch.zeros(4)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    for attempt in range(3):
        staged = stager.stage(state)
        while _copied(staged) < state["a.first"].numel() * 4:  # a.first is copied first
            time.sleep(0.0002)  # hands the copy the GIL
        state["a.first"].data.fill_(float(attempt + 1))
        state["z.last"].data.fill_(float(attempt + 1))
        still_copying = _copied(staged) < total  # so the comparison had not begun
        try:
            staged.wait()
        except TornSnapshotError as exc:
            assert exc.keys == ["a.first"]
            assert ".data" in str(exc)
        else:
            assert not still_copying, "a write seen by nothing was kept"
            assert staged.state_dict["z.last"].eq(attempt).all()  # all old, not mixed
        finally:
            staged.release()
        assert state["a.first"].eq(attempt + 1).all()  # the write itself stands
    stager.close()


def test_a_write_through_data_before_its_copy_is_of_the_copys_moment():
    """A write that lands before its tensor's copy began is in the snapshot (no counter
    and no comparison can tell it from one made before stage()); the tensors copied in
    the background are still all of one moment."""
    stager = StateStager(chunk_bytes=4096)
    state = {**_slow_copy_state(), "z.last": torch.zeros(4)}
    staged = stager.stage(state)
    state["z.last"].data.fill_(5.0)  # long before the copy reaches it
    staged.wait()
    assert staged.state_dict["z.last"].eq(5.0).all()
    assert staged.stats["verify_seconds"] > 0
    staged.release()
    stager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sources_are_compared_after_the_copy():
    stager = StateStager()
    state = {"w": torch.randn(2**22, device="cuda"), "b": torch.arange(7, device="cuda")}
    with stager.stage(state) as staged:  # unchanged: the comparison finds nothing
        staged.wait()
        _assert_same(state, staged.state_dict)
    for _ in range(3):
        state = {"w": torch.zeros(2**26, device="cuda"), "z": torch.zeros(4, device="cuda")}
        staged = stager.stage(state)
        state["w"].data.fill_(1.0)  # on the current stream, beside the side stream's copy
        state["z"].data.fill_(1.0)
        try:
            staged.wait()
        except TornSnapshotError:
            pass
        else:
            w, z = staged.state_dict["w"], staged.state_dict["z"]
            assert (w.eq(0).all() and z.eq(0).all()) or (w.eq(1).all() and z.eq(1).all())
        finally:
            staged.release()
    stager.close()


def test_second_stage_waits_for_release(stager):
    state = {"w": torch.ones(10)}
    staged = stager.stage(state)
    staged.wait()
    assert stager.busy
    with pytest.raises(StagingBusyError, match="release"):
        stager.stage(state, timeout=0.01)
    staged.release()
    assert not stager.busy
    with pytest.raises(CheckpointError, match="released"):
        staged.wait()
    stager.stage(state).release()


def test_release_before_the_copy_finished_aborts_it(stager):
    big = {f"t{i}": torch.randn(256, 1024) for i in range(16)}
    staged = stager.stage(big)
    staged.release()
    assert staged.done and staged.released
    with pytest.raises(CheckpointError):
        staged.wait()


def test_budget_is_enforced_and_nothing_is_lost():
    stager = StateStager(max_bytes=1000)
    with stager.stage({"small": torch.ones(100)}) as staged:
        staged.wait()
        ptr = staged.state_dict["small"].data_ptr()
    with pytest.raises(StagingBudgetError, match=r"'big' \(4000 B\)") as info:
        stager.stage({"small": torch.ones(100), "big": torch.ones(1000)})
    # small (400 B, under a page) takes a 448-byte slot of the small buffers' segment
    assert info.value.needed == 448 + 4000 and info.value.max_bytes == 1000
    assert stager.pool.nbytes == 400  # the earlier buffer is still held, unchanged
    with stager.stage({"small": torch.full((100,), 2.0)}) as staged:
        assert staged.state_dict["small"].data_ptr() == ptr
    stager.close()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.ones(3).to_sparse(), TypeError, r"'bad'.*sparse"),
        (torch.empty(3, device="meta"), ValueError, r"'bad' is a meta tensor"),
    ],
)
def test_bad_tensors_are_named(stager, value, error, match):
    with pytest.raises(error, match=match):
        stager.stage({"ok": torch.ones(2), "bad": value})
    assert not stager.busy


def test_bad_calls(stager):
    with pytest.raises(TypeError, match="mapping"):
        stager.stage([torch.ones(2)])
    with pytest.raises(ValueError, match="chunk_bytes"):
        StateStager(chunk_bytes=0)
    with pytest.raises(ValueError, match="max_bytes"):
        StateStager(max_bytes=-1)
    with pytest.raises(ValueError, match="copy_threads"):
        StateStager(copy_threads=0)
    for nice in (-1, 20):  # raising the copy above training is never what was meant
        with pytest.raises(ValueError, match=f"copy_nice .* got {nice}"):
            StateStager(copy_nice=nice)
    with pytest.raises(ValueError, match=r"'a\.b' appears twice"):
        stager.stage({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    stager.close()
    with pytest.raises(CheckpointError, match="closed"):
        stager.stage({"w": torch.ones(1)})


def test_inference_tensors_are_copied_synchronously(stager):
    with torch.inference_mode():
        t = torch.randn(100)
    with stager.stage({"t": t, "u": torch.randn(50)}) as staged:
        assert staged.stats["bytes_first"] == 400
        staged.wait()
        assert torch.equal(staged.state_dict["t"], t)


@pytest.mark.multiprocess
def test_dtensor_state_of_fsdp2_stages_and_round_trips_through_dcp(tmp_path):
    """Two real ranks (torchrun, gloo): staged DTensors keep mesh/placements; DCP saves them."""
    worker = Path(__file__).with_name("_dtensor_worker.py")
    check(torchrun(2, str(tmp_path / "ckpt"), script=worker, timeout=240))
    assert (tmp_path / "ckpt" / ".metadata").exists()


@pytest.mark.parametrize("saves", [16, pytest.param(300, marks=pytest.mark.slow)])
def test_soak_every_snapshot_is_exact_or_reported_torn(saves):
    """Many saves while training, some with a stray in-place write: never mixed values.

    A stray write racing the copy can land after the copy read the new data but before
    torch bumps the version counter; the verdict sealed in the step pre-hook catches it.
    """
    width = 256
    model = _model(width)
    opt = torch.optim.AdamW(model.parameters())
    stager = StateStager(chunk_bytes=16 * 1024)
    gen = torch.Generator().manual_seed(0)
    first = list(model.buffers())
    torn = clean = 0
    for i in range(saves):
        _train_step(model, opt, width)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
        expected = _snapshot(state)
        staged = stager.stage(state, first=first)
        stray = None
        if i % 2 and torch.rand((), generator=gen) < 0.8:  # something else writes a parameter
            stray = list(state["model"])[int(torch.randint(0, 4, (), generator=gen))]
            if stray.endswith(("running_mean", "running_var", "num_batches_tracked")):
                stray = "0.weight"
            state["model"][stray].add_(1.0)
        _train_step(model, opt, width)
        try:
            staged.wait()
        except TornSnapshotError as exc:
            torn += 1
            assert stray is not None and f"model.{stray}" in exc.keys
        else:
            clean += 1
            _assert_same(expected, staged.state_dict)
        staged.release()
    stager.close()
    assert clean > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux only")
@pytest.mark.parametrize("nice", [0, 10])
def test_the_background_copy_runs_at_the_priority_asked_for(nice):
    """Reniced, the copy takes the cores mostly while training waits, not in its stead."""
    s = StateStager(copy_nice=nice)
    try:
        with s.stage({"w": torch.ones(1 << 20)}) as staged:
            staged.wait()
            main = os.getpriority(os.PRIO_PROCESS, 0)
            assert staged._job.thread_nice == min(19, main + nice)
        assert os.getpriority(os.PRIO_PROCESS, 0) == main  # the training thread untouched
    finally:
        s.close()


def test_a_child_forked_during_a_copy_steps_its_optimizer_without_waiting_for_it():
    """A ``multiprocessing`` child fine-tuning a probe, forked right after a save began:
    its steps waited for the parent's copy, whose thread it does not have, for good."""
    width = 1024
    model = _model(width)
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, width)
    stager = StateStager(chunk_bytes=64 * 1024)  # many chunks: the copy takes a while
    staged = stager.stage({"model": model.state_dict(), "optim": opt.state_dict()})
    assert step_gate.copies_in_flight() == 1  # forked while the copy runs
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            # a small probe on one thread: OpenMP's pool does not survive a fork either
            torch.set_num_threads(1)
            probe = torch.nn.Linear(4, 1)
            probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
            probe(torch.ones(2, 4)).sum().backward()
            probe_opt.step()
            os.write(write, b"1")
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 30)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert ready and os.read(read, 1) == b"1", "the child's optimizer step hung"
    staged.wait()
    staged.release()
    stager.close()


def test_every_copy_runs_on_one_long_lived_thread_and_a_forked_child_copies_too(stager):
    """A thread ended per save could end as a DataLoader forks its workers, and on
    CPython before 3.11.10 (gh-112275) the worker would then hang for good. The copies
    share one thread that waits for the next; a forked child starts its own."""
    state = {"w": torch.arange(8192.0)}
    seen = []
    for _ in range(4):
        state["w"].add_(1.0)
        with stager.stage(state) as staged:
            staged.wait()
            assert torch.equal(staged.state_dict["w"], state["w"])
        time.sleep(0.05)  # a thread of its own per copy would be gone by now
        seen.append([t.ident for t in threading.enumerate() if t.name == "unbroken-staging"])
    assert seen[0] and all(idents == seen[0] for idents in seen), seen  # one per nice value
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a copy must still run (its copier is its own; the
        ok = False  # parent's buffers are not inherited, so a stager of its own)
        try:
            mine = StateStager()
            with mine.stage({"w": torch.ones(8192)}) as staged:
                staged.wait(timeout=30)
                ok = bool(torch.equal(staged.state_dict["w"], torch.ones(8192)))
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
