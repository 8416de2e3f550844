"""HostBufferPool: reuse per key, bounded by max_bytes, realloc only on a changed spec."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from unbroken._util.direct_io import DirectFileWriter, open_direct
from unbroken._util.host_memory import HUGE_PAGE, host_buffer
from unbroken.checkpoint.staging.errors import CheckpointError, StagingBudgetError
from unbroken.checkpoint.staging.host_buffers import BufferSpec, HostBufferPool, segment_layout


def test_same_specs_reuse_the_same_buffers():
    pool = HostBufferPool()
    specs = {"a": BufferSpec((4, 5), torch.float32), "b": BufferSpec((3,), torch.int64)}
    first, allocated = pool.reserve(specs)
    assert allocated == 128 + 3 * 8  # both under a page: 64-byte slots of one segment
    for _ in range(5):
        again, allocated = pool.reserve(dict(specs))
        assert allocated == 0
        assert {k: v.data_ptr() for k, v in again.items()} == {
            k: v.data_ptr() for k, v in first.items()
        }
    assert pool.allocations == 2
    assert first["a"].shape == (4, 5) and first["a"].dtype == torch.float32
    assert first["a"].is_contiguous() and not first["a"].is_shared()


def test_changed_dtype_or_shape_reallocates_that_key_only():
    pool = HostBufferPool()
    n = 2048  # a page or more in both dtypes: buffers of their own
    a0 = pool.reserve({"a": BufferSpec((n,), torch.float32), "b": BufferSpec((n,), torch.float32)})[
        0
    ]
    a1, allocated = pool.reserve(
        {"a": BufferSpec((n,), torch.bfloat16), "b": BufferSpec((n,), torch.float32)}
    )
    assert allocated == 2 * n
    assert a1["a"].dtype == torch.bfloat16
    assert a1["b"].data_ptr() == a0["b"].data_ptr()
    assert pool.nbytes == 2 * n + 4 * n and len(pool) == 2


def test_small_private_buffers_share_one_segment():
    """A page each would hold 4 KiB for every scalar (Adam's step, biases): hundreds of
    MiB for a large model's state, unseen by max_bytes."""
    pool = HostBufferPool()
    specs = {f"s{i}": BufferSpec((), torch.float32) for i in range(2000)}
    specs["norm"] = BufferSpec((1000,), torch.float32)  # 4000 bytes: still under a page
    specs["big"] = BufferSpec((4096,), torch.float32)  # 16 KiB: a buffer of its own
    out, allocated = pool.reserve(specs)
    segment = 2000 * 64 + 4000  # 64-byte slots, not pages
    assert allocated == segment + 16384 == pool.nbytes  # max_bytes sees the slots
    small = [out[k] for k in specs if k != "big"]
    storage = small[0].untyped_storage()
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in small)
    assert storage.nbytes() == segment
    assert out["big"].untyped_storage().data_ptr() != storage.data_ptr()
    assert out["big"].data_ptr() % 4096 == 0 and out["norm"].data_ptr() % 64 == 0
    # Buffers do not overlap: each holds its own value.
    for i in range(2000):
        out[f"s{i}"].fill_(float(i))
    assert [float(out[f"s{i}"]) for i in range(0, 2000, 199)] == list(range(0, 2000, 199))
    # The segment is private, page-aligned memory left out of forked children.
    assert "dc" in _mapping(storage.data_ptr())["VmFlags"].split()
    assert not small[0].is_shared()
    # Reused while the small specs hold; one changed spec lays the segment out again.
    again, allocated = pool.reserve(dict(specs))
    assert allocated == 0 and again["s7"].data_ptr() == out["s7"].data_ptr()
    changed = dict(specs, s7=BufferSpec((2,), torch.float32))
    after, allocated = pool.reserve(changed)
    assert allocated == segment and after["s7"].shape == (2,)
    assert after["big"].data_ptr() == out["big"].data_ptr()
    assert pool.nbytes == segment + 16384 and len(pool) == len(specs)
    assert pool.reserve({"big": specs["big"]})[1] == 0 and len(pool) == 1
    assert pool.nbytes == 16384


@pytest.mark.parametrize("shared", [False, True])
def test_a_buffer_pickled_whole_gets_a_storage_of_its_own(shared):
    """torch.save writes a view's whole storage: a tensor DCP pickles (inside a tuple)
    must not be a view of the segment, or every such value would carry all of it."""
    pool = HostBufferPool(shared_memory=shared)
    specs = {f"s{i}": BufferSpec((), torch.float32) for i in range(100)}
    specs["pos"] = BufferSpec((2,), torch.int64, own_storage=True)
    out, _ = pool.reserve(specs)
    assert out["pos"].untyped_storage().nbytes() == 16
    assert out["pos"].is_shared() is shared
    assert out["s0"].untyped_storage().nbytes() >= 100 * 4


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


def _mapping(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``ptr``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if inside:
                    break
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= ptr < end
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


def _transparent_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_private_buffers_are_page_aligned_and_large_ones_get_huge_pages():
    pool = HostBufferPool()
    # 12 MiB and a few bytes: the tail is not rounded up to a whole huge page.
    out, _ = pool.reserve(
        {"big": BufferSpec((3 << 20 | 5,), torch.float32), "small": BufferSpec((10,), torch.int64)}
    )
    big, small = out["big"], out["small"]
    assert small.data_ptr() % 4096 == 0 and big.data_ptr() % 4096 == 0
    big.fill_(1.0)  # fault it in
    flags = _mapping(big.data_ptr())["VmFlags"].split()
    assert "hg" in flags and "dc" in flags  # huge pages advised, not copied into children
    assert "hg" not in _mapping(small.data_ptr())["VmFlags"].split()
    if not _transparent_huge_pages():
        pytest.skip("transparent huge pages are off on this machine")
    # The kernel took the advice (how much of it depends on free memory), within the
    # buffer: its tail was not rounded up to a whole huge page.
    backing = int(_mapping(big.data_ptr())["AnonHugePages"].split()[0]) * 1024
    assert HUGE_PAGE <= backing <= big.nbytes


def test_a_private_buffer_is_written_in_place_with_o_direct(tmp_path):
    pool = HostBufferPool()
    out, _ = pool.reserve({"w": BufferSpec((1 << 20,), torch.float32)})
    out["w"].copy_(torch.arange(1 << 20, dtype=torch.float32))
    path = tmp_path / "w.bin"
    fd, direct = open_direct(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        writer = DirectFileWriter(fd, direct=direct)
        writer.write(memoryview(out["w"].numpy()).cast("B"))
        writer.close()
    finally:
        os.close(fd)
    if not direct:
        pytest.skip("this file system refuses O_DIRECT")
    assert writer.in_place_bytes == out["w"].nbytes  # no bounce copy at all
    assert path.read_bytes() == out["w"].numpy().tobytes()


def test_host_buffer_refuses_a_negative_size():
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        host_buffer(-1)


def _mapped_in(pid: int, ptr: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= ptr < end:
                return True
    return False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_private_buffers_are_not_inherited_by_forked_children():
    # A forked DataLoader worker must not share the pool copy-on-write: the next save
    # would copy every page the child still shares.
    pool = HostBufferPool()
    out, _ = pool.reserve({"w": BufferSpec((1 << 20,), torch.float32)})
    ptr = out["w"].data_ptr()
    assert _mapped_in(os.getpid(), ptr)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and leaves at once, touching nothing
        os.write(write, b"1" if _mapped_in(os.getpid(), ptr) else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"0"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_shared_buffers_are_one_segment_so_thousands_of_tensors_take_one_descriptor():
    """torch keeps a shared segment's descriptor open: one segment per tensor ran out of
    file descriptors with a few thousand tensors (an Adam model of ~500 parameters)."""
    pool = HostBufferPool(shared_memory=True)
    specs = {f"step{i}": BufferSpec((), torch.float32) for i in range(3000)}
    specs |= {"big": BufferSpec((3, 1000), torch.float64), "bf": BufferSpec((7,), torch.bfloat16)}
    specs["empty"] = BufferSpec((0, 4), torch.float32)
    fds_before = len(os.listdir("/proc/self/fd"))
    out, allocated = pool.reserve(specs)
    assert len(os.listdir("/proc/self/fd")) - fds_before <= 1
    in_segment = {k: s for k, s in specs.items() if s.nbytes}
    assert allocated == pool.nbytes == segment_layout(in_segment)[1]
    assert all(out[k].is_shared() for k in specs if k != "empty")
    assert out["big"].data_ptr() % 4096 == 0 and out["big"].is_contiguous()
    spans = sorted((b.data_ptr(), b.data_ptr() + b.nbytes) for b in out.values() if b.nbytes)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "buffers overlap"
    for i, key in enumerate(specs):
        out[key].fill_(i % 100)
    assert all(bool((out[k] == i % 100).all()) for i, k in enumerate(specs))
    again, allocated = pool.reserve(dict(reversed(list(specs.items()))))
    assert allocated == 0 and again["big"].data_ptr() == out["big"].data_ptr()
    grown, allocated = pool.reserve({**specs, "big": BufferSpec((4, 1000), torch.float64)})
    assert allocated == pool.nbytes and grown["big"].shape == (4, 1000)
    assert len(os.listdir("/proc/self/fd")) - fds_before <= 2
    pool.clear()
    assert pool.nbytes == 0


def test_forget_drops_the_buffers_placed_elsewhere_and_keeps_the_rest():
    """An arena takes the big tensors from the next save on: the pool stops holding them
    (a third copy of the state) but keeps what the arena has no place for."""
    pool = HostBufferPool()
    n = 4096
    specs = {
        "placed": BufferSpec((n,), torch.float32),
        "changed": BufferSpec((n,), torch.float32),
        "kept": BufferSpec((n,), torch.float32),
        "small": BufferSpec((3,), torch.float32),
    }
    pool.reserve(specs)
    dropped = pool.forget(
        {
            "placed": ((n,), torch.float32),
            "changed": ((n,), torch.float64),  # the arena's slot is another dtype: kept
            "small": ((3,), torch.float32),  # in the shared segment: kept
            "absent": ((n,), torch.float32),
        }
    )
    assert dropped == 4 * n
    assert "placed" not in pool
    assert all(k in pool for k in ("changed", "kept", "small"))
    assert pool.forget({"placed": ((n,), torch.float32)}) == 0  # already gone
    again, allocated = pool.reserve(specs)  # the arena failed after all: made again
    assert allocated == 4 * n and again["placed"].shape == (n,)
