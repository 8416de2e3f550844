"""Volumes of small numbered files on a local path or the loopback S3 server."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import make_store_url
from unbroken import open_store
from unbroken.data import DataLoader, VolumeDataset


def decode_index(data: bytes, path: str) -> int:
    """Each test file holds its own sample index as text."""
    return int(data)


def decode_augmented(data: bytes, path: str) -> tuple[int, float, float, float]:
    """A sample plus one draw from each global RNG: a stand-in for a random crop."""
    return int(data), torch.rand(1).item(), float(np.random.rand()), random.random()


@dataclass
class Volume:
    """A directory of ``n`` files ``s0000.txt``... holding their index, and its caches."""

    url: str
    options: dict[str, Any]
    n: int
    tmp: Any
    made: list[DataLoader] = field(default_factory=list)

    def dataset(self, **kw: Any) -> VolumeDataset:
        kw.setdefault("decode", decode_index)
        kw.setdefault("cache_dir", str(self.tmp / "cache"))
        kw.setdefault("storage_options", self.options or None)
        return VolumeDataset(self.url, **kw)

    def loader(self, *, batch_size: int = 2, num_workers: int = 0, **kw: Any) -> DataLoader:
        loader_kw = {
            k: kw.pop(k)
            for k in (
                "drop_last",
                "collate_fn",
                "timeout",
                "persistent_workers",
                "multiprocessing_context",
                "fill_ahead",
                "worker_init_fn",
            )
            if k in kw
        }
        ld = DataLoader(
            self.dataset(**kw), batch_size=batch_size, num_workers=num_workers, **loader_kw
        )
        self.made.append(ld)
        return ld

    def ranks(self, world_size: int, **kw: Any) -> list[DataLoader]:
        """One loader per rank, as each rank of a job would make it."""
        return [self.loader(rank=r, world_size=world_size, **kw) for r in range(world_size)]

    @property
    def store(self):
        return open_store(self.url, **self.options)


def write_volume(url: str, options: dict, n: int) -> None:
    store = open_store(url, **options)
    for i in range(n):
        store.write_bytes(f"d{i % 3}/s{i:04d}.txt", str(i).encode())


@pytest.fixture
def make_volume(tmp_path, s3_server_lazy):
    """make_volume(n, backend="local"|"s3") -> Volume."""
    made: list[Volume] = []

    def make(n: int = 24, backend: str = "local") -> Volume:
        url, options = make_store_url(backend, tmp_path / f"v{len(made)}", s3_server_lazy)
        write_volume(url, options, n)
        vol = Volume(url, options, n, tmp_path / f"v{len(made)}")
        made.append(vol)
        return vol

    yield make
    for vol in made:
        for ld in vol.made:
            it = getattr(ld, "_iterator", None)
            if it is not None:
                it._shutdown_workers()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request) -> str:
    return request.param
