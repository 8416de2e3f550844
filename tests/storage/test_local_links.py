"""A LocalStore never follows a symbolic link: no key reaches outside its root."""

from __future__ import annotations

import os

import pytest

import unbroken as ub


@pytest.fixture
def rooted(tmp_path):
    """A store whose root holds a link to a directory outside it, and a link to a file."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not yours")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "dirlink")
    os.symlink(outside / "secret", root / "filelink")
    return ub.open_store(str(root)), outside


def test_writes_through_a_directory_link_are_refused(rooted):
    store, outside = rooted
    with pytest.raises(ub.StoreError, match=r"dirlink.*symbolic link"):
        store.write_bytes("dirlink/x", b"escaped")
    with pytest.raises(ub.StoreError, match="symbolic link"):
        store.write_bytes("dirlink/x", b"escaped", create_only=True)
    assert sorted(os.listdir(outside)) == ["secret"]


def test_deletes_through_a_directory_link_are_refused(rooted):
    store, outside = rooted
    with pytest.raises(ub.StoreError, match="symbolic link"):
        store.delete("dirlink/secret")
    with pytest.raises(ub.StoreError, match="symbolic link"):
        store.delete("dirlink")
    assert (outside / "secret").read_bytes() == b"not yours"


def test_reads_of_a_linked_file_are_refused_by_name(rooted, tmp_path):
    store, _ = rooted
    for call in (
        lambda: store.read_bytes("filelink"),
        lambda: store.read_bytes("dirlink/secret"),
        lambda: store.download("filelink", tmp_path / "copy"),
        lambda: store.info("filelink"),
    ):
        with pytest.raises(ub.StoreError, match=r"filelink|dirlink"):
            call()
    assert not (tmp_path / "copy").exists()


def test_a_root_that_is_itself_a_link_is_fine(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "alias")
    store = ub.open_store(str(tmp_path / "alias"))
    store.write_bytes("a/b", b"ok")
    assert (real / "a" / "b").read_bytes() == b"ok"
