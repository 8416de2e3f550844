"""The emulated link's bandwidth is shared by every process on the node."""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
import uuid

import pytest

from unbroken.storage.link import SharedLink


def _transfer(name: str, bandwidth: float, nbytes: int) -> None:
    SharedLink(bandwidth, name).transfer(nbytes)


@pytest.mark.multiprocess
def test_parallel_processes_share_one_timeline():
    name = f"test-{uuid.uuid4().hex[:8]}"
    bandwidth, nbytes, procs = 400e6, 20 << 20, 4
    start = time.monotonic()
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_transfer, args=(name, bandwidth, nbytes)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    link = SharedLink(bandwidth, name)
    with open(link.path, "rb") as f:
        (free_at,) = struct.unpack("<d", f.read(8))
    # The reserved timeline covers every byte of every process back to back: had each
    # process kept its own link, it would end after nbytes / bandwidth instead.
    assert free_at - start >= 0.95 * procs * nbytes / bandwidth


def test_link_rejects_bad_settings():
    with pytest.raises(ValueError, match="bandwidth"):
        SharedLink(0)
    with pytest.raises(ValueError, match="link name"):
        SharedLink(1e6, "../etc")
