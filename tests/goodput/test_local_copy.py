"""The node's copy of an attempt's event log: appends, reads, and a disk that fills up."""

from __future__ import annotations

import gc
import os
import warnings

from unbroken.goodput.local_copy import LocalCopy


def test_appends_are_read_back_from_an_offset_and_removed_with_the_folder(tmp_path):
    copy = LocalCopy(str(tmp_path / "_goodput"), "a1", 0)
    assert copy.append(b"one\n") and copy.append(b"two\n")
    assert copy.nbytes == 8 and copy.read(4) == b"two\n"
    copy.remove()
    assert not (tmp_path / "_goodput").exists()


def test_a_full_disk_stops_the_copy_and_closes_its_file(tmp_path):
    """A full staging disk left the file open (a ResourceWarning at exit)."""
    folder = tmp_path / "_goodput"
    folder.mkdir()
    copy = LocalCopy(str(folder), "a1", 0)
    os.symlink("/dev/full", copy.path)  # every write: ENOSPC
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        assert not copy.append(b"start\n")
        gc.collect()
    assert copy.stopped and not copy.opened
    assert not copy.append(b"later\n")  # the file may lack events now: it stays stopped
