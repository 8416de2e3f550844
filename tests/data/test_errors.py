"""Bad files and bad volumes: clear errors naming the file and the URL, or counted skips."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.data.helpers import flatten, serve
from unbroken.data import VolumeDataset
from unbroken.data.dataset import SampleReadError
from unbroken.data.index import EmptyVolumeError


def picky_decode(data: bytes, path: str) -> int:
    if data == b"corrupt":
        raise ValueError("not a number")
    return int(data)


@pytest.mark.parametrize("workers", [0, 1])
def test_missing_file_raises_naming_file_and_url(make_volume, backend, workers):
    vol = make_volume(8, backend)
    ld = vol.loader(batch_size=2, num_workers=workers, shuffle=False)
    vol.store.delete("d1/s0004.txt")  # listed in the index, gone from the volume
    with pytest.raises(
        SampleReadError, match=r"cannot read 'd1/s0004.txt' from .*" + re.escape(vol.url[-20:])
    ):
        list(ld)


def test_undecodable_file_raises_naming_it(make_volume):
    vol = make_volume(6)
    vol.store.write_bytes("d0/s0003.txt", b"corrupt")
    ld = vol.loader(batch_size=2, decode=picky_decode, shuffle=False)
    with pytest.raises(SampleReadError, match=r"cannot decode 'd0/s0003.txt'.*not a number"):
        list(ld)


def test_skip_counts_bad_files_and_keeps_the_position(make_volume):
    vol = make_volume(12)
    vol.store.write_bytes("d0/s0003.txt", b"corrupt")
    ld = vol.loader(
        batch_size=2, num_workers=2, decode=picky_decode, on_error="skip", shuffle=False
    )
    vol.store.delete("d1/s0004.txt")
    vol.store.delete("d2/s0002.txt")
    served = [s for b in ld for s in flatten(b)]
    assert sorted(served) == sorted(set(range(12)) - {2, 3, 4})
    assert ld.metrics.skipped == 3
    assert ld.state_dict()["epoch"] == 1  # the epoch still ran to its end


def test_a_batch_of_only_bad_files_is_skipped_whole(make_volume):
    vol = make_volume(6)
    ld = vol.loader(batch_size=2, on_error="skip", shuffle=False)
    for key in ("d0/s0000.txt", "d0/s0003.txt"):  # index order: the first batch
        vol.store.delete(key)
    batches = [flatten(b) for b in ld]
    assert len(batches) == 2 and ld.metrics.skipped == 2 and ld.metrics.batches == 2


def test_a_whole_batch_of_bad_files_on_one_rank_of_several_is_raised_not_skipped(make_volume):
    """Skipped whole, that rank would take one step fewer than the others: a hang at
    their next collective, or gradients of different steps averaged."""
    vol = make_volume(8)
    vol.store.write_bytes("d0/s0003.txt", b"corrupt")
    ranks = vol.ranks(2, batch_size=1, decode=picky_decode, on_error="skip", shuffle=False)
    with pytest.raises(SampleReadError, match=r"every file of batch \d+ of epoch 0 on rank 1 of 2"):
        serve(ranks)
    (alone,) = vol.ranks(1, batch_size=1, decode=picky_decode, on_error="skip", shuffle=False)
    assert sorted(s for b in alone for s in flatten(b)) == [0, 1, 2, 4, 5, 6, 7]
    # iterated alone (a plain torch DataLoader) nothing keeps ranks in step: skipped
    second = vol.dataset(rank=1, world_size=2, decode=picky_decode, on_error="skip", shuffle=False)
    assert sorted(second) == [1, 5, 7]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_of_only_bad_files_is_raised_not_served_empty(make_volume, workers):
    """A hostile user's find: with every file failing, the README loop (``while step <
    total: for batch in loader``) asked for empty epochs for ever."""
    vol = make_volume(6)

    def nothing_decodes(data: bytes, path: str) -> int:
        raise ValueError("not an image")

    ld = vol.loader(batch_size=2, num_workers=workers, decode=nothing_decodes, on_error="skip")
    with pytest.raises(SampleReadError, match=r"epoch 0 on rank 0 served nothing"):
        for _ in ld:
            pass
    assert ld.metrics.skipped == 6
    if workers == 0:  # a plain torch DataLoader: only one process sees the whole epoch
        plain = torch.utils.data.DataLoader(
            vol.dataset(decode=nothing_decodes, on_error="skip"), batch_size=2
        )
        with pytest.raises(SampleReadError, match=r"epoch 0 on rank 0 served nothing"):
            list(plain)


def test_a_plain_dataloader_over_fewer_files_than_ranks_is_refused_not_served_empty(
    make_volume,
):
    """As ub.DataLoader refuses it: served empty, a step-counting loop spins for ever."""
    vol = make_volume(1)
    with pytest.raises(ValueError, match=r"1 files at .* for 2 ranks: rank 1 gets none"):
        list(torch.utils.data.DataLoader(vol.dataset(rank=1, world_size=2), batch_size=None))


def test_bad_arguments_are_refused(make_volume, tmp_path):
    vol = make_volume(4)
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        vol.dataset(on_error="ignore")
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        vol.dataset(rank=2, world_size=2)
    with pytest.raises(EmptyVolumeError, match=r"no files at .*missing-volume"):
        VolumeDataset(str(tmp_path / "missing-volume"), cache_dir=str(tmp_path / "c"))
    from unbroken.data import DataLoader

    with pytest.raises(TypeError, match="'shuffle' is not supported"):
        DataLoader(vol.dataset(), batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match="serves a VolumeDataset"):
        DataLoader([1, 2, 3], batch_size=2)


def test_bad_loader_and_dataset_options_are_refused(make_volume):
    from unbroken.data import DataLoader

    vol = make_volume(4)
    ds = vol.dataset()
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        DataLoader(ds, batch_size=0)
    with pytest.raises(ValueError, match="in_order=False would break exact resume"):
        DataLoader(ds, batch_size=2, in_order=False)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        vol.dataset(seed=-1)
    with pytest.raises(ValueError, match="prefetch_depth and prefetch_threads must be >= 1"):
        vol.dataset(prefetch_depth=0)
    with pytest.raises(ValueError, match="not a byte size"):
        vol.dataset(cache_limit="lots")


@pytest.mark.parametrize("limit", [0, "0GB", -1, "lots", 0.5])
def test_a_cache_limit_that_holds_nothing_is_refused_naming_the_cache(make_volume, limit):
    vol = make_volume(4)
    cache = str(vol.tmp / "cache")
    with pytest.raises(ValueError, match=rf"cache_limit.*{re.escape(cache)}"):
        vol.dataset(cache_limit=limit)


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_dir_that_cannot_hold_files_is_refused_at_construction(make_volume, where):
    vol = make_volume(4)
    blocker = vol.tmp / "blocker"
    blocker.write_text("a file, not a directory")
    cache_dir = str(blocker if where == "a file" else blocker / "cache")
    with pytest.raises(OSError, match=rf"cache_dir {re.escape(cache_dir)}"):
        vol.dataset(cache_dir=cache_dir)


FULL_CACHE_DISK = """
import resource, signal, sys
import unbroken as ub
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # a nearly full disk
ds = ub.VolumeDataset(sys.argv[1], cache_dir=sys.argv[2], on_error="skip", shuffle=False)
try:
    print("served", sum(len(b) for b in ub.DataLoader(ds, batch_size=1, num_workers=0)))
except ub.CacheWriteError as e:
    print("ERROR:", e)
"""


@pytest.mark.multiprocess
def test_a_full_cache_disk_is_raised_even_where_bad_files_are_skipped(tmp_path):
    """A full local disk is not a bad file: skipping would train on a shrinking subset."""
    volume = tmp_path / "volume"
    volume.mkdir()
    for i in range(4):
        (volume / f"{i}.bin").write_bytes(bytes([i]) * 100_000)
    run = subprocess.run(
        [sys.executable, "-c", FULL_CACHE_DISK, str(volume), str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "ERROR: LocalCache: cannot store '0.bin' (100000 bytes) in the cache at " in run.stdout
    assert str(tmp_path / "cache") in run.stdout and "skipped" not in run.stderr
