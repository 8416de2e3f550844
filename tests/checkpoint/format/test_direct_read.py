"""From a local directory, tensor payloads land in their targets' memory, still verified."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.format_util import load_from, publish, save_step, spy_reads
from unbroken import open_store
from unbroken.checkpoint.errors import CheckpointCorruptError
from unbroken.checkpoint.format.direct_read import read_into, writable_bytes
from unbroken.checkpoint.format.manifest import crc32c_bytes, step_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


def test_writable_bytes_is_the_tensors_own_memory():
    t = torch.zeros(4, 3, dtype=torch.float64)
    view = writable_bytes(t)
    assert view is not None and view.nbytes == t.nbytes
    view[: t.element_size()] = torch.tensor([2.5], dtype=torch.float64).view(torch.uint8).numpy()
    assert t[0, 0].item() == 2.5
    row = writable_bytes(t[1:3])  # a contiguous slice: its own bytes only
    assert row is not None and row.nbytes == 2 * 3 * 8


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(4, 3).t(),  # not contiguous
        torch.zeros(8)[::2],
        torch.zeros(3, dtype=torch.complex64).conj(),  # lazy conjugate
        torch.zeros(2, device="meta"),
    ],
    ids=["transposed", "strided", "conj", "meta"],
)
def test_writable_bytes_refuses_memory_that_is_not_the_elements_in_order(tensor):
    assert writable_bytes(tensor) is None


def test_read_into_fills_the_buffer_and_checksums_it(tmp_path, monkeypatch):
    import unbroken.checkpoint.format.direct_read as direct_read

    monkeypatch.setattr(direct_read, "READ_CHUNK", 1000)  # several chunks
    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    path.write_bytes(data)
    out = torch.zeros(5000, dtype=torch.uint8)
    with open(path, "rb") as f:
        got, crc = read_into(f.fileno(), 100, writable_bytes(out))
        assert (got, crc) == (5000, crc32c_bytes(data[100:5100]))
        assert bytes(out.numpy()) == data[100:5100]
        short, _ = read_into(f.fileno(), len(data) - 10, writable_bytes(out))
    assert short == 10


def test_local_tensors_are_read_into_their_targets_not_through_the_store(tmp_path):
    sd = {"w": torch.randn(300, 7), "b": torch.arange(11.0), "k": {"x": 3}}
    directory, manifest = save_step(tmp_path / "stage", 4, sd)
    store = open_store(tmp_path / "local")
    publish(directory, store, manifest)
    reads = spy_reads(store)
    target = {"w": torch.zeros(300, 7), "b": torch.zeros(11), "k": {"x": 0}}
    w_memory, w_version = target["w"].data_ptr(), target["w"]._version
    out = load_from(store, manifest, target)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert out["k"] == {"x": 3} and out["w"].data_ptr() == w_memory
    assert out["w"]._version > w_version  # an in-place write, as copy_ would record it
    # Only the value (bytes, unpickled with weights_only) went through a ranged read.
    shard_reads = [n for key, n in reads if key == f"{step_dir(4)}/{SHARD}"]
    assert len(shard_reads) == 1 and shard_reads[0] < sd["w"].nbytes


def test_targets_that_cannot_take_bytes_in_place_are_still_loaded(tmp_path):
    sd = {"t": torch.randn(5, 9), "h": torch.randn(6).to(torch.float16)}
    directory, manifest = save_step(tmp_path / "stage", 4, sd)
    store = open_store(tmp_path / "local")
    publish(directory, store, manifest)
    target = {"t": torch.zeros(9, 5).t(), "h": torch.zeros(6, dtype=torch.float16)}
    out = load_from(store, manifest, target)
    assert not out["t"].is_contiguous()
    assert torch.equal(out["t"], sd["t"]) and torch.equal(out["h"], sd["h"])


def test_a_flip_read_in_place_is_still_detected(tmp_path):
    sd = {"w": torch.randn(4096)}
    directory, manifest = save_step(tmp_path / "stage", 4, sd)
    store = open_store(tmp_path / "local")
    publish(directory, store, manifest)
    path = Path(store.path_for(f"{step_dir(4)}/{SHARD}"))
    data = bytearray(path.read_bytes())
    data[-5000] ^= 0x10  # inside w's payload (the trailer is shorter than this)
    path.write_bytes(data)
    with pytest.raises(CheckpointCorruptError, match="crc32c mismatch") as info:
        load_from(store, manifest, {"w": torch.zeros(4096)})
    assert info.value.file == SHARD
