"""metadata.json carries all of DCP's Metadata and refuses anything it cannot trust."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

from tests.checkpoint.format_util import save_step
from unbroken.checkpoint.errors import CheckpointCorruptError
from unbroken.checkpoint.format.dcp_json import metadata_from_json, metadata_to_json

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(tmp_path):
    sd = {
        "model": {"w": torch.randn(3, 5), "b": torch.zeros(5, dtype=torch.bfloat16)},
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1, "ids": [0]}]},
        "epoch": 4,
    }
    directory, _ = save_step(tmp_path, 1, sd)
    return directory


def test_json_matches_the_pickled_metadata(saved):
    md = metadata_from_json((saved / "metadata.json").read_bytes(), where="metadata.json")
    with open(saved / ".metadata", "rb") as f:
        vanilla = pickle.load(f)  # our own freshly written file, in a test
    assert md.state_dict_metadata == vanilla.state_dict_metadata
    assert md.planner_data == vanilla.planner_data
    assert md.version == vanilla.version
    assert {k: v.to_vanilla() for k, v in md.storage_data.items()} == vanilla.storage_data
    assert md.storage_meta.save_id == vanilla.storage_meta.save_id
    # and it survives a second round trip unchanged
    assert metadata_to_json(md) == (saved / "metadata.json").read_bytes()


def test_planner_data_keeps_tuples_and_int_indices(saved):
    md = metadata_from_json((saved / "metadata.json").read_bytes(), where="m")
    path = md.planner_data["opt.groups.0.lr"]
    assert path == ("opt", "groups", 0, "lr") and isinstance(path[2], int)  # a list index
    assert md.planner_data["opt.state.0.step"] == ("opt", "state", "0", "step")  # a dict key


def tamper(saved, mutate) -> bytes:
    doc = json.loads((saved / "metadata.json").read_bytes())
    mutate(doc)
    return json.dumps(doc).encode()


def first_tensor(doc):
    return next(v for v in doc["state_dict_metadata"].values() if v["type"] == "tensor")


def first_location(doc):
    return next(e for e in doc["storage_data"] if e["dtype"] is not None)


HOSTILE = {
    "dtype names a function": lambda d: first_tensor(d)["properties"].update(dtype="load"),
    "dtype names a module": lambda d: first_tensor(d)["properties"].update(dtype="nn"),
    "layout is a dtype": lambda d: first_tensor(d)["properties"].update(layout="float32"),
    "payload dtype": lambda d: first_location(d).update(dtype="os.system"),
    "unknown item type": lambda d: first_tensor(d).update(type="pickle"),
    "negative size": lambda d: first_tensor(d).update(size=[-1, 5]),
    "chunk rank": lambda d: first_tensor(d)["chunks"][0].update(offsets=[0]),
    "file escapes": lambda d: first_location(d).update(file="../../etc/passwd"),
    "payload outside record": lambda d: first_location(d).update(payload=[10**9, 4]),
    "crc too big": lambda d: first_location(d).update(crc32c=2**40),
    "wrong format": lambda d: d.update(format="something-else"),
    "future version": lambda d: d.update(version=42),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_refused_with_the_file_named(saved, case):
    data = tamper(saved, HOSTILE[case])
    where = "s3://b/step/metadata.json"
    with pytest.raises(CheckpointCorruptError, match=re.escape(where)) as info:
        metadata_from_json(data, where=where)
    assert info.value.file == "metadata.json"


def test_not_json_is_refused():
    with pytest.raises(CheckpointCorruptError, match="malformed"):
        metadata_from_json(b"\x80\x04K\x01.", where="x/metadata.json")


def test_reserved_tuple_key_in_planner_data_is_refused():
    from torch.distributed.checkpoint.metadata import Metadata

    md = Metadata(state_dict_metadata={}, planner_data={"__tuple__": 1}, storage_data={})
    with pytest.raises(ValueError, match="__tuple__"):
        metadata_to_json(md)
