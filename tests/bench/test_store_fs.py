"""The bench-only fsspec adapter: DCP and torch.save go through a Store and come back whole."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from bench.storage.store_fs import StoreFileSystem
from tests.conftest import BACKENDS
from tests.link_names import private_link


@pytest.fixture
def fs_options(store_url, tmp_path) -> dict:
    url, options = store_url
    spill = tmp_path / "spill"
    spill.mkdir()
    return {"store_url": url, "spill_dir": str(spill), **options}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.arange(7, dtype=torch.int64)}


@pytest.mark.parametrize("store_url", BACKENDS, indirect=True)
def test_dcp_save_and_load_through_a_store(fs_options):
    saved = _state()
    dcp.save(saved, storage_writer=FsspecWriter("ubstore://ck/step-1", **fs_options))
    fs = StoreFileSystem(**fs_options)
    names = {e.key for e in fs.store.list("ck/step-1")}
    assert "ck/step-1/.metadata" in names
    assert not any(".tmp" in n for n in names), names  # the rename really moved it
    assert os.listdir(fs_options["spill_dir"]) == []  # spill files never outlive a write

    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=FsspecReader("ubstore://ck/step-1", **fs_options))
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k


@pytest.mark.parametrize("store_url", ["local", "memory"], indirect=True)
def test_torch_save_and_load_through_a_store(fs_options):
    saved = _state()
    with fsspec.open("ubstore://full/step-2.pt", "wb", **fs_options) as f:
        torch.save(saved, f)
    with fsspec.open("ubstore://full/step-2.pt", "rb", **fs_options) as f:
        loaded = torch.load(f, weights_only=True)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_emulated_link_carries_the_bytes(tmp_path):
    """Through ``emulated::`` the adapter pays latency per request, like every row."""
    options = {
        "store_url": f"emulated::{tmp_path / 'remote'}",
        "latency": 0.0,
        "bandwidth": "1GB",
        "link": private_link("store-fs"),
    }
    fs = StoreFileSystem(**options)
    fs.pipe_file("ubstore://a/b", b"x" * 1000)
    assert fs.cat_file("ubstore://a/b", 10, 20) == b"x" * 10
    assert (tmp_path / "remote" / "a" / "b").stat().st_size == 1000


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_listing_and_info(fs_options):
    fs = StoreFileSystem(**fs_options)
    fs.pipe_file("ubstore://d/x/1", b"1")
    fs.pipe_file("ubstore://d/y", b"22")
    assert fs.ls("ubstore://d", detail=False) == ["d/x", "d/y"]
    assert fs.info("ubstore://d/y") == {"name": "d/y", "size": 2, "type": "file"}
    assert fs.info("ubstore://d")["type"] == "directory"
    fs.mv("ubstore://d/y", "ubstore://d/z")
    assert not fs.exists("ubstore://d/y") and fs.cat_file("ubstore://d/z") == b"22"
    fs.rm("ubstore://d")
    assert not fs.exists("ubstore://d/x/1")


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_bad_inputs_name_the_object(fs_options):
    fs = StoreFileSystem(**fs_options)
    with pytest.raises(FileNotFoundError, match="nothing/here"):
        fs.open("ubstore://nothing/here", "rb")
    with pytest.raises(NotImplementedError, match=r"'ab'.*some/key"):
        fs.open("ubstore://some/key", "ab")
    with pytest.raises(ValueError, match=r"\.\."):
        fs.pipe_file("ubstore://a/../b", b"no")


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_a_failed_write_uploads_nothing(fs_options):
    fs = StoreFileSystem(**fs_options)
    with pytest.raises(RuntimeError, match="boom"), fs.open("ubstore://half", "wb") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert not fs.exists("ubstore://half")
    assert os.listdir(fs_options["spill_dir"]) == []
