"""Save with TierWriter, load with TierReader (every backend) and with vanilla DCP."""

from __future__ import annotations

import mmap
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.checkpoint.format_util import assert_same, load_from, publish, save_step
from unbroken import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.uint16,
]
SHAPES = [(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4)]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def page_aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in page-aligned memory of its own."""
    out = torch.frombuffer(mmap.mmap(-1, t.nbytes), dtype=t.dtype).reshape(t.shape)
    out.copy_(t)
    return out


def full_state() -> dict:
    sd = {
        f"t{i}_{j}": make(dt, shape, i * 10 + j)
        for i, dt in enumerate(DTYPES)
        for j, shape in enumerate(SHAPES)
    }
    big = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd["transposed"] = big.t()  # non-contiguous source
    sd["sliced"] = big[1:4, 2:7]  # view with a storage offset
    sd["conj"] = torch.tensor([1 + 2j, 3 - 4j]).conj()
    # Large payloads start on a 4 KiB boundary and go out with O_DIRECT: from their own
    # memory when it is page-aligned (as staging buffers are), through the bounce buffer
    # when not (ordinary allocations, an offset view).
    sd["large"] = make(torch.float32, (70_000,), 1)
    sd["large_page_aligned"] = page_aligned(make(torch.float32, (50_001,), 5))
    sd["large_odd_length"] = make(torch.float64, (16_667,), 2)
    sd["large_unaligned"] = make(torch.float32, (40_001,), 3)[1:]
    sd["large_transposed"] = make(torch.bfloat16, (300, 250), 4).t()
    sd["meta"] = {"epoch": 3, "name": "run-7", "lr": [0.1, 0.01], "nested": {"k": (1, 2)}}
    sd["count"] = 12
    return sd


def empty_like_state(sd: dict) -> dict:
    def blank(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v.contiguous())
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        return None

    return {k: blank(v) for k, v in sd.items()}


def expected(sd: dict) -> dict:
    return {
        k: (v.resolve_conj().contiguous() if isinstance(v, torch.Tensor) else v)
        for k, v in sd.items()
    }


def test_round_trip_every_backend(store, tmp_path):
    sd = full_state()
    directory, manifest = save_step(tmp_path / "stage", 42, sd)
    publish(directory, store, manifest)
    out = load_from(store, manifest, empty_like_state(sd))
    assert_same(out, expected(sd))


def test_round_trip_no_verify_and_many_windows(tmp_path, monkeypatch):
    import unbroken.checkpoint.format.read_plan as read_plan

    monkeypatch.setattr(read_plan, "WINDOW_BYTES", 4096)  # force many windows and read-ahead
    monkeypatch.setattr(read_plan, "MERGE_GAP", 0)
    sd = {f"w{i}": torch.randn(300 + i) for i in range(20)}
    directory, manifest = save_step(tmp_path / "stage", 1, sd)
    store = open_store(tmp_path / "durable")
    publish(directory, store, manifest)
    assert_same(load_from(store, manifest, empty_like_state(sd)), sd)
    assert_same(load_from(store, manifest, empty_like_state(sd), verify=False), sd)


def test_vanilla_dcp_load_reads_a_local_copy(tmp_path):
    sd = full_state()
    directory, _ = save_step(tmp_path / "stage", 7, sd)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    out = empty_like_state(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(copy), no_dist=True)
    assert_same(out, expected(sd))


def test_one_file_per_rank_and_records_match_disk(tmp_path):
    directory, manifest = save_step(tmp_path / "stage", 3, full_state())
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".metadata", "__0_0.distcp", "metadata.json"]
    for name, rec in manifest.files.items():
        path = directory / name
        assert path.stat().st_size == rec.size
        from unbroken.checkpoint.format.manifest import crc32c_file

        assert crc32c_file(path) == rec.crc32c


def test_payloads_are_raw_tensor_bytes(tmp_path):
    """The shard holds each tensor's bytes verbatim at its aligned payload offset."""
    from unbroken.checkpoint.format.dcp_json import metadata_from_json

    t = torch.arange(1000, dtype=torch.int32)
    directory, _ = save_step(tmp_path / "stage", 1, {"t": t})
    md = metadata_from_json((directory / "metadata.json").read_bytes(), where="metadata.json")
    (loc,) = md.storage_data.values()
    assert loc.payload_offset % 64 == 0 and loc.payload_length == t.nbytes
    blob = (directory / loc.relative_path).read_bytes()
    assert blob[loc.payload_offset : loc.payload_offset + loc.payload_length] == t.numpy().tobytes()


def test_large_payloads_start_on_block_boundaries(tmp_path):
    from unbroken.checkpoint.format.dcp_json import metadata_from_json
    from unbroken.checkpoint.format.tensor_record import DIRECT_PAYLOAD_MIN

    sd = full_state()
    directory, _ = save_step(tmp_path / "stage", 1, sd)
    md = metadata_from_json((directory / "metadata.json").read_bytes(), where="metadata.json")
    large = [loc for loc in md.storage_data.values() if loc.payload_length >= DIRECT_PAYLOAD_MIN]
    assert len(large) == 5
    assert [loc.payload_offset % 4096 for loc in large] == [0] * 5
    # Small records stay packed: padding is only where a large payload needs it.
    records = sum(loc.length for loc in md.storage_data.values())
    assert (directory / "__0_0.distcp").stat().st_size < records + 6 * 4096


def test_module_and_optimizer_round_trip(store, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    directory, manifest = save_step(tmp_path / "stage", 5, {"model": msd, "optim": osd})
    publish(directory, store, manifest)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2(torch.randn(3, 4)).sum().backward()
    optim2.step()
    msd2, osd2 = get_state_dict(model2, optim2)
    state = {"model": msd2, "optim": osd2}
    load_from(store, manifest, state)
    set_state_dict(model2, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert optim2.param_groups[0]["lr"] == pytest.approx(0.01)
    s1, s2 = optim.state_dict()["state"], optim2.state_dict()["state"]
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][name], s2[k][name])


def test_without_collectives_each_rank_names_its_own_files(tmp_path):
    """dcp.save(use_collectives=False): per-rank names, and vanilla DCP still loads them."""
    from tests.checkpoint.format_util import TierWriter

    sd = {"w": torch.arange(6.0), "k": 5}
    writer = TierWriter(tmp_path / "c")
    dcp.save(sd, storage_writer=writer, no_dist=True, use_collectives=False)
    names = sorted(r.name for r in writer.records)
    assert names == ["__0.metadata", "__0.metadata.json", "__0_0.distcp"]
    out = {"w": torch.zeros(6), "k": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path / "c"), no_dist=True)
    assert_same(out, sd)


def test_envelope_over_4gib_loads_with_torch(tmp_path):
    """A >4 GiB tensor's envelope (zip64) is valid: checked on a sparse file via mmap."""
    from unbroken.checkpoint.format.tensor_record import envelope

    n = (5 << 30) + 3
    header, trailer = envelope(torch.uint8, (n,))
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(header)
        f.seek(len(header) + n - 1)
        f.write(b"\x07")  # the last payload byte; the rest is a hole that reads as zeros
        f.write(trailer)
    loaded = torch.load(path, mmap=True, weights_only=True)
    assert loaded.shape == (n,) and loaded[-1].item() == 7 and loaded[0].item() == 0


def test_kept_parts_are_each_file_byte_for_byte(tmp_path):
    """What an upload from memory sends is exactly what the local tier holds."""
    from unbroken.checkpoint.format.writer import TierWriter

    sd = full_state()
    sd["big"] = torch.randn(300_000)  # a payload written in place, from its own memory
    writer = TierWriter(tmp_path / "stage", keep_parts=True)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert sorted(writer.parts) == sorted(r.name for r in writer.records)
    for name, parts in writer.parts.items():
        on_disk = (tmp_path / "stage" / name).read_bytes()
        assert b"".join(bytes(p) for p in parts) == on_disk, name
    shard = writer.parts["__0_0.distcp"]
    big = sd["big"].numpy()
    # Views, not copies: the payload part shares the tensor's memory.
    (view,) = [p for p in shard if p.nbytes == big.nbytes]
    assert view.tobytes()[:16] == big.tobytes()[:16]
    sd["big"][0] = 1234.5
    assert view.tobytes()[:4] == sd["big"][:1].numpy().tobytes()
    assert TierWriter(tmp_path / "other").parts == {}  # kept only when asked
