"""Helpers for the format tests: save a step with TierWriter, publish it to a store."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from unbroken import __version__
from unbroken.checkpoint.format.dcp_load import load_state_dict
from unbroken.checkpoint.format.manifest import Manifest, step_dir, write_manifest
from unbroken.checkpoint.format.reader import TierReader
from unbroken.checkpoint.format.tensor_record import raw_view
from unbroken.checkpoint.format.writer import TierWriter
from unbroken.storage import Store

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def save_step(
    root: Path, step: int, state_dict: dict[str, Any], **writer_kw: Any
) -> tuple[Path, Manifest]:
    """Save with TierWriter into ``root/step-...``; return the directory and its manifest."""
    directory = root / step_dir(step)
    writer = TierWriter(directory, **writer_kw)
    dcp.save(state_dict, storage_writer=writer, no_dist=True)
    files = {r.name: r for r in writer.records}
    manifest = Manifest(step, 1, files, __version__, torch.__version__, time.time(), {})
    return directory, manifest


def publish(directory: Path, store: Store, manifest: Manifest) -> None:
    """Upload every file the manifest lists, then commit by writing the manifest."""
    prefix = step_dir(manifest.step)
    for name in manifest.files:
        store.upload(os.path.join(directory, name), f"{prefix}/{name}")
    write_manifest(store, manifest)


def load_from(store: Store, manifest: Manifest, template: dict[str, Any], **kw) -> dict:
    load_state_dict(template, TierReader(store, manifest.step, manifest, **kw))
    return template


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert np.array_equal(raw_view(a), raw_view(b)), (a, b)  # bitwise, NaN-safe
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def spy_reads(store) -> list[tuple[str, int]]:
    """Every read of ``store`` (whole or ranged) as (key, bytes)."""
    reads: list[tuple[str, int]] = []

    def spy(read):
        def reading(key, start=None, end=None):
            data = read(key, start, end)
            reads.append((key, memoryview(data).nbytes))
            return data

        return reading

    store.read_bytes, store.read_range = spy(store.read_bytes), spy(store.read_range)
    return reads
