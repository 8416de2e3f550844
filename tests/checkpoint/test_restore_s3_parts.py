"""Restore from S3 (the real SeaweedFS server, native backend): a tensor comes straight
into its target's memory as parallel ranged reads of at most PART_BYTES, each checked,
the parts' checksums folded; bytes exactly right, a flipped byte in any part caught."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import unbroken as ub
import unbroken.checkpoint.format.read_plan as read_plan
from tests.checkpoint.format_util import load_from, publish, save_step, spy_reads
from unbroken.checkpoint.errors import CheckpointCorruptError
from unbroken.checkpoint.format.manifest import step_dir

PART = 64 << 10


def test_a_plain_sgd_job_restores_from_s3_in_bounded_parts(tmp_path, s3_server, monkeypatch):
    monkeypatch.setattr(read_plan, "PART_BYTES", PART)
    url = f"s3://{s3_server.new_root()}/ckpt"
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 10))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 300)).sum().backward()
    optim.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [optim.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    options = dict(storage_options=s3_server.storage_options, goodput=False, mlflow=False)
    with ub.CheckpointManager(url, staging_dir=tmp_path / "s", every_steps=None, **options) as m:
        m.save(7, {"model": model, "optim": optim})
        m.wait()
    shutil.rmtree(tmp_path / "s")  # every byte from S3
    fresh = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 10))
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with ub.CheckpointManager(url, staging_dir=tmp_path / "e", every_steps=None, **options) as m:
        reads = spy_reads(m.store)
        assert m.restore({"model": fresh, "optim": fresh_optim}) == 7
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key
    for p, expected in zip(fresh.parameters(), momentum):
        assert torch.equal(fresh_optim.state[p]["momentum_buffer"], expected)
    shard = [n for key, n in reads if key.endswith(".distcp")]
    weight = 300 * 200 * 4  # the first weight and its momentum: several parts each
    assert max(shard) <= PART and sum(shard) >= 2 * weight
    assert len(shard) >= 2 * (weight // PART)


@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_a_flip_in_any_part_is_caught(tmp_path, s3_server, monkeypatch, where):
    monkeypatch.setattr(read_plan, "PART_BYTES", PART)
    sd = {"w": torch.randn(100_000)}  # 400 KB: seven parts
    directory, manifest = save_step(tmp_path / "stage", 4, sd)
    store = ub.open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    publish(directory, store, manifest)
    key = f"{step_dir(4)}/__0_0.distcp"
    data = bytearray(store.read_bytes(key))
    raw = sd["w"].numpy().tobytes()
    flip = data.find(raw[:64]) + int(len(raw) * where)  # inside the payload
    data[flip] ^= 0x04
    store.write_bytes(key, bytes(data))
    with pytest.raises(CheckpointCorruptError, match="crc32c mismatch"):
        load_from(store, manifest, {"w": torch.zeros(100_000)})
    unchecked = load_from(store, manifest, {"w": torch.zeros(100_000)}, verify=False)["w"]
    assert int(unchecked.ne(sd["w"]).sum()) == 1  # the flip landed where it was made


def test_a_restore_from_s3_fetches_each_small_file_once(tmp_path, s3_server):
    """Each request to a far store costs its latency: the staging attempt that finds no
    local copy hands what it read to the durable attempt, and DCP's second load pass
    takes metadata.json from the reader, not from S3 again."""
    url = f"s3://{s3_server.new_root()}/ckpt"
    model = nn.Linear(64, 8)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    options = dict(storage_options=s3_server.storage_options, goodput=False, mlflow=False)
    with ub.CheckpointManager(url, staging_dir=tmp_path / "s", every_steps=None, **options) as m:
        m.save(4, {"model": model, "optim": optim, "epoch": 2})
        m.wait()
    state = {"model": nn.Linear(64, 8), "epoch": 0}
    state["optim"] = torch.optim.Adam(state["model"].parameters())
    with ub.CheckpointManager(url, staging_dir=tmp_path / "e", every_steps=None, **options) as m:
        reads = spy_reads(m.store)
        assert m.restore(state) == 4
    assert state["epoch"] == 2 and torch.equal(state["model"].weight, model.weight)
    small = sorted(key.rsplit("/", 1)[-1] for key, _ in reads if not key.endswith(".distcp"))
    assert small == ["manifest.json", "metadata.json", "rank-00000.json"]
