"""A LocalStore never follows a symbolic link: no key reaches outside its root. Its
listing skips nothing it could miss: what it cannot list raises, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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


def test_a_link_out_of_the_root_is_no_object_of_the_store_and_is_noted_where_asked(rooted):
    """A hostile user's find: a linked folder was left out of a dataset's listing
    without a word, a linked file listed and then refused mid-epoch. A store lists
    neither (a ``tb -> /scratch/tb`` link beside the checkpoints must not break them),
    and notes both for a caller that asks (a dataset refuses them, docs/data.md)."""
    store, _ = rooted
    assert store.list() == []
    unlisted: list[tuple[str, str]] = []
    assert store.list(unlisted=unlisted) == []
    assert sorted(k for k, _ in unlisted) == ["dirlink/", "filelink"]  # a folder: "/"
    assert all("symbolic link to" in why and "elsewhere" in why for _, why in unlisted)


def test_a_listing_skips_links_inside_the_root_which_name_what_it_lists(tmp_path):
    """A ``latest`` link beside the checkpoints, even once its step is gone, and an
    alias of a file: their targets are listed under their own names."""
    root = tmp_path / "root"
    (root / "step-2").mkdir(parents=True)
    (root / "step-2" / "shard").write_bytes(b"x")
    os.symlink("step-2", root / "latest")
    os.symlink(root / "step-1", root / "previous")  # retention removed it
    os.symlink("../step-2/shard", root / "step-2" / "alias")
    (root / "lost+found").mkdir()
    (root / "lost+found" / "#1234").write_bytes(b"fsck's")
    os.mkfifo(root / "pipe")  # a read of it would block for ever: no object either
    store = ub.open_store(str(root))
    unlisted: list[tuple[str, str]] = []
    assert [e.key for e in store.list(unlisted=unlisted)] == ["step-2/shard"]
    assert unlisted == []


_LIST_AS_A_USER = """
import sys, unbroken as ub
store = ub.open_store(sys.argv[1])
unlisted = []
print(sorted(e.key for e in store.list(unlisted=unlisted)), unlisted)
try:
    print(sorted(e.key for e in store.list()))
except ub.StoreError as e:
    print("REFUSED", e)
"""


def _list_without_root_privileges(root) -> list[str]:
    """List ``root`` in a process that file modes bind (root's CAP_DAC_* dropped)."""
    cmd = [sys.executable, "-c", _LIST_AS_A_USER, str(root)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes do not bind")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_listing_names_a_folder_it_cannot_read(tmp_path):
    """An unreadable folder was listed as empty: a dataset lost its files without a word,
    and an unreadable checkpoint folder made restore() start from scratch."""
    root = tmp_path / "root"
    for folder in ("open", "closed", "lost+found"):
        (root / folder).mkdir(parents=True)
    (root / "open" / "a").write_bytes(b"a")
    (root / "closed" / "b").write_bytes(b"b")
    (root / "closed").chmod(0)
    (root / "lost+found").chmod(0)  # fsck's, at a mount's root: never data
    try:
        noted, plain = _list_without_root_privileges(root)
        assert noted == "['open/a'] [('closed/', 'cannot be read (Permission denied)')]"
        assert plain.startswith("REFUSED") and f"{root}/closed" in plain, plain
        (root / "closed").chmod(0o755)
        noted, plain = _list_without_root_privileges(root)
        assert noted == "['closed/b', 'open/a'] []" and plain == "['closed/b', 'open/a']"
    finally:
        for folder in ("closed", "lost+found"):
            (root / folder).chmod(0o755)
