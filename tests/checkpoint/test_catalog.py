"""The catalog over a store: committed vs partial, with the reason, and deep verify."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.format_util import publish, save_step
from unbroken.checkpoint.catalog import (
    list_checkpoints,
    newest_committed,
    verify_checkpoint,
)
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, step_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


def commit(tmp_path, store, step: int):
    directory, manifest = save_step(tmp_path / "stage", step, {"w": torch.full((64,), step)})
    publish(directory, store, manifest)
    return manifest


def test_empty_store_has_no_checkpoints(store):
    assert list_checkpoints(store) == []
    assert newest_committed(store) is None


def test_committed_and_partial(store, tmp_path):
    m10 = commit(tmp_path, store, 10)
    commit(tmp_path, store, 20)
    commit(tmp_path, store, 30)
    store.write_bytes(f"{step_dir(40)}/{SHARD}", b"half a shard")  # a save still running
    store.write_bytes("unrelated/file", b"x")  # not a checkpoint
    store.delete(f"{step_dir(20)}/{SHARD}")  # a committed checkpoint lost a file
    rewrite = store.read_bytes(f"{step_dir(30)}/{SHARD}")[:-5]
    store.write_bytes(f"{step_dir(30)}/{SHARD}", rewrite)  # truncated

    infos = list_checkpoints(store)
    assert [i.step for i in infos] == [10, 20, 30, 40]
    by = {i.step: i for i in infos}
    assert by[10].committed and by[10].problem is None
    assert by[10].nbytes == m10.nbytes and by[10].world_size == 1
    assert by[10].created == pytest.approx(m10.created)
    assert by[10].url == store.url_for(step_dir(10))
    assert not by[20].committed and f"{SHARD}: missing" in by[20].problem
    assert not by[30].committed and "bytes, manifest says" in by[30].problem
    assert not by[40].committed and "no manifest" in by[40].problem
    assert by[40].created is None and by[40].nbytes == len(b"half a shard")
    assert newest_committed(store).step == 10


def test_unparseable_manifest_is_partial_with_reason(tmp_path):
    from unbroken import open_store

    store = open_store(tmp_path / "durable")
    commit(tmp_path, store, 5)
    store.write_bytes(f"{step_dir(5)}/{MANIFEST_NAME}", b"{not json")
    (info,) = list_checkpoints(store)
    assert not info.committed
    assert "manifest is not valid JSON" in info.problem and MANIFEST_NAME in info.problem


def test_catalog_lists_the_root_once(tmp_path):
    """One listing of the root, one manifest read per checkpoint, no request per file."""
    from unbroken import open_store

    store = open_store(tmp_path / "durable")
    for step in (1, 2, 3):
        commit(tmp_path, store, step)
    calls = []
    for name in ("list", "read_bytes", "info", "exists"):
        original = getattr(store, name)

        def spy(*a, _original=original, _name=name, **kw):
            calls.append((_name, a[0] if a else ""))
            return _original(*a, **kw)

        setattr(store, name, spy)
    assert all(i.committed for i in list_checkpoints(store))
    assert [c for c in calls if c[0] == "list"] == [("list", "")]
    assert sorted(c[1] for c in calls if c[0] == "read_bytes") == [
        f"{step_dir(s)}/{MANIFEST_NAME}" for s in (1, 2, 3)
    ]
    assert not [c for c in calls if c[0] in ("info", "exists")]


def test_verify_shallow_and_deep(store, tmp_path):
    commit(tmp_path, store, 7)
    assert verify_checkpoint(store, 7) == []
    assert verify_checkpoint(store, 7, deep=True) == []
    key = f"{step_dir(7)}/{SHARD}"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x10
    store.write_bytes(key, bytes(data))
    assert verify_checkpoint(store, 7) == []  # same size: shallow cannot tell
    (problem,) = verify_checkpoint(store, 7, deep=True)
    assert SHARD in problem and "crc32c" in problem


def test_verify_reports_missing_manifest_and_files(store, tmp_path):
    (problem,) = verify_checkpoint(store, 3)
    assert "no manifest" in problem and "step 3" in problem
    commit(tmp_path, store, 4)
    store.delete(f"{step_dir(4)}/metadata.json")
    assert verify_checkpoint(store, 4, deep=True) == ["metadata.json: missing"]
