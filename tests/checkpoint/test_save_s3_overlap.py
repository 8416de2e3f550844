"""A save to S3 (the real SeaweedFS server, native backend) on the disk tier uploads each
shard from the host buffers while the same shard is written to the staging tier, not
after it: the commit waits for the longer of the two, not their sum. A failed local
write still fails the save (nothing committed), and the next save commits. (On the
memory tier the save helper uploads the memory copy's files: test_save_helper.py.)"""

from __future__ import annotations

import errno
import time

import pytest
import torch
from torch import nn

import unbroken as ub
from unbroken.checkpoint.format.manifest import step_dir
from unbroken.checkpoint.format.writer import TierWriter


def _job() -> dict:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(8, 256)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def _manager(tmp_path, name, url, server) -> ub.CheckpointManager:
    return ub.CheckpointManager(
        url, staging_dir=tmp_path / name, every_steps=None, goodput=False, mlflow=False,
        storage_options=server.storage_options, memory_tier=False,
    )  # fmt: skip


def test_the_shard_is_in_s3_before_its_local_copy_is_written(tmp_path, s3_server, monkeypatch):
    url = f"s3://{s3_server.new_root()}/ckpt"
    store = ub.open_store(url, **s3_server.storage_options)
    seen: list[bool] = []
    write = TierWriter._write_parts

    def local_write_after_upload(self, path, name, parts):
        deadline = time.monotonic() + 60
        key = f"{step_dir(3)}/{name}"
        while not store.exists(key) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(store.exists(key))
        return write(self, path, name, parts)

    monkeypatch.setattr(TierWriter, "_write_parts", local_write_after_upload)
    state = _job()
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with _manager(tmp_path, "s", url, s3_server) as mgr:
        assert mgr.save(3, state)
        mgr.wait()
        assert mgr.stats.committed == 1 and mgr.stats.bytes_from_memory > 0
    assert seen == [True]  # the upload did not wait for the local write
    for tier in ("s", "empty"):  # the staging tier's copy, then every byte from S3
        fresh = _job()
        for p in fresh["model"].parameters():
            p.data.zero_()
        with _manager(tmp_path, tier, url, s3_server) as mgr:
            assert mgr.restore(fresh) == 3
        for k, v in fresh["model"].state_dict().items():
            assert torch.equal(v, expected[k]), (tier, k)


def test_a_failed_local_write_fails_the_save_and_the_next_one_commits(
    tmp_path, s3_server, monkeypatch
):
    url = f"s3://{s3_server.new_root()}/ckpt"
    store = ub.open_store(url, **s3_server.storage_options)
    write = TierWriter._write_parts
    full = [True]

    def disk_full_once(self, path, name, parts):
        if full.pop() if full else False:
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return write(self, path, name, parts)

    monkeypatch.setattr(TierWriter, "_write_parts", disk_full_once)
    state = _job()
    with _manager(tmp_path, "s", url, s3_server) as mgr:
        mgr.save(1, state)
        with pytest.raises(ub.SaveFailedError, match=r"local staging tier .* No space left"):
            mgr.wait()
        assert mgr.stats.failed == 1 and mgr.stats.committed == 0
        assert not store.exists(f"{step_dir(1)}/manifest.json")
        mgr.save(2, state)
        mgr.wait()
        assert mgr.stats.committed == 1
    with _manager(tmp_path, "e", url, s3_server) as mgr:
        assert mgr.restore(_job()) == 2


@pytest.fixture(autouse=True)
def _quiet_dcp_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
