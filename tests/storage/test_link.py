"""The emulated link's bandwidth is shared by every process on the node."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time

import pytest

from tests.link_names import discard_links, private_link
from unbroken.storage.link import SharedLink, discard_link


def _transfer(name: str, bandwidth: float, nbytes: int) -> None:
    SharedLink(bandwidth, name).transfer(nbytes)


def _transfer_on(link: SharedLink, nbytes: int) -> None:
    link.transfer(nbytes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_parallel_processes_share_one_timeline(start_method):
    name = private_link("timeline")
    bandwidth, nbytes, procs = 400e6, 20 << 20, 4
    start = time.monotonic()
    ctx = mp.get_context(start_method)
    if start_method == "fork":
        # Children inherit a link whose file the parent already opened (and locks).
        link = SharedLink(bandwidth, name)
        link.transfer(1)
        workers = [ctx.Process(target=_transfer_on, args=(link, nbytes)) for _ in range(procs)]
    else:
        workers = [
            ctx.Process(target=_transfer, args=(name, bandwidth, nbytes)) for _ in range(procs)
        ]
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


def test_a_made_up_link_leaves_no_state_file_once_discarded():
    name = private_link("discard")
    link = SharedLink(1e9, name)
    link.transfer(1)
    link.close()
    assert os.path.exists(link.path)
    assert discard_links(name) == 1  # what the session's teardown does for every test link
    assert not os.path.exists(link.path)
    assert discard_link(name) is False  # already gone: nothing to do, no error


def test_a_bad_link_name_is_refused_when_discarding_too():
    for bad in ("../etc", "a/b", ""):
        with pytest.raises(ValueError, match="link name"):
            discard_link(bad)


def test_reservations_are_slices_of_link_time():
    """Few wake-ups per second on a fast link, never tiny slices on a slow one."""
    assert SharedLink(200e6, private_link("slices")).slice_bytes == 4_000_000  # 20 ms
    assert SharedLink(1e6, private_link("slices")).slice_bytes == 1 << 20
