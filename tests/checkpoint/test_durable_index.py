"""The coordinator's index of the durable tier: what it remembers between saves."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint.format_util import publish, save_step
from unbroken import open_store
from unbroken.checkpoint.durable_index import DurableIndex
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    SELF_CHECKSUM,
    manifest_checksum,
    step_dir,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_step_a_newer_unbroken_committed_is_remembered_not_read_at_every_save(tmp_path):
    store = open_store(tmp_path / "durable")
    for step in (1, 2):
        directory, manifest = save_step(tmp_path / "stage", step, {"w": torch.ones(8) * step})
        publish(directory, store, manifest)
    key = f"{step_dir(2)}/{MANIFEST_NAME}"
    doc = json.loads(store.read_bytes(key))
    doc.update(format=2, library_version="9.0.0")
    doc[SELF_CHECKSUM] = manifest_checksum(doc)
    store.write_bytes(key, json.dumps(doc).encode())

    index = DurableIndex(store)
    assert index.committed_steps() == {1}
    assert index.newer_format(2) is not None and "9.0.0" in index.newer_format(2).problem
    assert index.newer_format(1) is None
    reads = []
    original = store.read_bytes
    store.read_bytes = lambda k, *a, **kw: reads.append(k) or original(k, *a, **kw)
    listed = index.checkpoints()  # what each retention pass reads: one listing, no manifest
    assert [(c.step, c.committed, c.newer_format) for c in listed] == [
        (1, True, False),
        (2, False, True),
    ]
    assert reads == []
