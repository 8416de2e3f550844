"""The manifest (commit record) and step naming: round trips and every bad input."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken import __version__, open_store
from unbroken.checkpoint.errors import CheckpointCorruptError, NewerFormatError, NoCheckpointError
from unbroken.checkpoint.format import manifest as manifest_module
from unbroken.checkpoint.format.manifest import (
    SELF_CHECKSUM,
    FileRecord,
    Manifest,
    crc32c_bytes,
    crc32c_file,
    manifest_checksum,
    odd_step_dir,
    parse_step_dir,
    read_manifest,
    step_dir,
    verify_committed_files,
    write_manifest,
)
from unbroken.storage import ObjectNotFoundError


def sample(step: int = 1200) -> Manifest:
    files = {
        "__0_0.distcp": FileRecord("__0_0.distcp", 1000, 123),
        "rng/rank-00001.json": FileRecord("rng/rank-00001.json", 10, 2**32 - 1),
    }
    return Manifest(step, 2, files, "0.1.0", "2.13.0", 1700000000.5, {"loader": {"epoch": 2}})


def test_round_trip_and_nbytes():
    m = sample()
    assert Manifest.from_json(m.to_json(), where="x") == m
    assert m.nbytes == 1010


def test_write_and_read_through_store(store):
    m = sample(7)
    write_manifest(store, m)
    assert store.exists("step-000000000007/manifest.json")
    assert read_manifest(store, 7) == m


def test_missing_manifest_names_the_url(store):
    with pytest.raises(NoCheckpointError, match="step 3") as info:
        read_manifest(store, 3)
    assert store.url_for("step-000000000003/manifest.json") in str(info.value)


def test_manifest_for_another_step_is_refused(tmp_path):
    store = open_store(tmp_path)
    store.write_bytes("step-000000000005/manifest.json", sample(6).to_json())
    with pytest.raises(CheckpointCorruptError, match=r"says step 6.*step 5"):
        read_manifest(store, 5)


def edit(mutate) -> bytes:
    """The sample's JSON changed by ``mutate``, without its own checksum (as written before
    there was one), so that each check below is reached."""
    doc = json.loads(sample().to_json())
    doc.pop(SELF_CHECKSUM)
    mutate(doc)
    return json.dumps(doc).encode()


def _set(doc, key, value):
    doc[key] = value


BAD = {
    "not json": b"{oops",
    "not an object": b"[1, 2]",
    "no step": edit(lambda d: d.pop("step")),
    "negative step": edit(lambda d: _set(d, "step", -1)),
    "bool size": edit(lambda d: d["files"][0].update(size=True)),
    "negative size": edit(lambda d: d["files"][0].update(size=-5)),
    "string crc": edit(lambda d: d["files"][0].update(crc32c="abc")),
    "dotdot name": edit(lambda d: d["files"][0].update(name="../evil")),
    "absolute name": edit(lambda d: d["files"][0].update(name="/etc/passwd")),
    "lists itself": edit(lambda d: d["files"][0].update(name="manifest.json")),
    "duplicate": edit(lambda d: d["files"].append(dict(d["files"][0]))),
    "format 0": edit(lambda d: _set(d, "format", 0)),
    "format as text": edit(lambda d: _set(d, "format", "2")),
    "no world": edit(lambda d: _set(d, "world_size", 0)),
    "extra not object": edit(lambda d: _set(d, "extra", [1])),
    "not utf8": b"\xff\xfe",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_manifest_is_a_clear_error(name):
    with pytest.raises(CheckpointCorruptError, match=re.escape("s3://b/step-1/manifest.json")):
        Manifest.from_json(BAD[name], where="s3://b/step-1/manifest.json")


def newer(doc: dict) -> dict:
    """``doc`` as a newer unbroken would write it: another layout, its checksum kept."""
    doc.update(format=2, library_version="9.1.0", files="a layout of the future")
    doc[SELF_CHECKSUM] = manifest_checksum(doc)
    return doc


def test_a_manifest_of_a_newer_format_is_refused_as_newer_not_as_corrupt():
    """Its other fields may mean something else there: only the step and the version
    that wrote it are read, to say so (its own checksum is computed as every format does)."""
    doc = newer(json.loads(sample().to_json()))
    with pytest.raises(NewerFormatError) as info:
        Manifest.from_json(json.dumps(doc).encode(), where="s3://b/step-1/manifest.json")
    assert not isinstance(info.value, CheckpointCorruptError)
    assert str(info.value).startswith(
        "s3://b/step-1/manifest.json: step 1200 was written by unbroken 9.1.0 (format 2); "
        f"this is unbroken {__version__}, which reads format 1: upgrade"
    )
    assert (info.value.step, info.value.format, info.value.library_version) == (1200, 2, "9.1.0")


@pytest.mark.parametrize("flipped", [3, 5, 9])
def test_a_newer_format_whose_checksum_fails_is_corrupt_not_newer(flipped):
    """A flipped bit in "format" (1 -> 3, 5, 9) must not pass for a newer unbroken's
    checkpoint: restore would refuse every run instead of falling back past it."""
    data = sample().to_json()
    damaged = data.replace(b'"format": 1', f'"format": {flipped}'.encode())
    assert damaged != data
    with pytest.raises(CheckpointCorruptError, match="its own checksum does not match"):
        Manifest.from_json(damaged, where="s3://b/step-1/manifest.json")


def test_a_newer_format_without_its_checksum_is_corrupt():
    doc = newer(json.loads(sample().to_json()))
    doc.pop(SELF_CHECKSUM)
    claim = f"claims format 2 but carries no {SELF_CHECKSUM}"
    with pytest.raises(CheckpointCorruptError, match=claim):
        Manifest.from_json(json.dumps(doc).encode(), where="s3://b/step-1/manifest.json")


def test_a_manifest_changed_after_it_was_written_is_refused():
    text = sample().to_json().decode()
    assert '"epoch": 2' in text
    changed = text.replace('"epoch": 2', '"epoch": 3').encode()
    with pytest.raises(CheckpointCorruptError, match="its own checksum does not match"):
        Manifest.from_json(changed, where="s3://b/step-1/manifest.json")


def test_a_manifest_without_its_own_checksum_is_read_as_it_is():
    assert Manifest.from_json(edit(lambda d: None), where="x") == sample()


@given(st.integers(0, 10**15))
def test_step_dir_round_trip(step):
    assert parse_step_dir(step_dir(step)) == step


@given(st.integers(0, 10**12 - 1), st.integers(0, 10**12 - 1))
def test_lexical_order_is_step_order(a, b):
    assert (step_dir(a) < step_dir(b)) == (a < b)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", None])
def test_step_dir_refuses_bad_steps(bad):
    with pytest.raises(ValueError, match="step"):
        step_dir(bad)


@pytest.mark.parametrize("name", ["step-12", "step-", "stage-000000000001", "step-00000000001x"])
def test_parse_step_dir_ignores_other_names(name):
    assert parse_step_dir(name) is None


@pytest.mark.parametrize("name", ["step-0000000000099", "step-12", "step-01000000000000"])
def test_a_step_name_step_dir_does_not_write_is_not_a_step(name):
    """Read as a step, it would send readers to the canonical name: another directory."""
    assert parse_step_dir(name) is None and odd_step_dir(name)
    assert parse_step_dir("step-1000000000000") == 10**12 and not odd_step_dir(step_dir(99))


def test_crc32c_known_vector_and_file(tmp_path):
    assert crc32c_bytes(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    data = bytes(range(256)) * 50000
    path = tmp_path / "f"
    path.write_bytes(data)
    assert crc32c_file(path) == crc32c_bytes(data)
    assert crc32c_bytes(data[1000:], crc32c_bytes(data[:1000])) == crc32c_bytes(data)


def test_new_manifest_stamps_versions_and_refuses_conflicting_reports():
    import torch

    from unbroken import __version__
    from unbroken.checkpoint.format.manifest import new_manifest

    a = FileRecord("__0_0.distcp", 10, 1)
    m = new_manifest(5, 2, [a, FileRecord("__1_0.distcp", 20, 2), a], extra={"x": 1})
    assert m.nbytes == 30 and m.world_size == 2 and m.extra == {"x": 1}
    assert m.library_version == __version__ and m.torch_version == torch.__version__
    assert m.created > 0
    with pytest.raises(ValueError, match=r"'__0_0.distcp' reported twice"):
        new_manifest(5, 2, [a, FileRecord("__0_0.distcp", 11, 1)])
    with pytest.raises(ValueError, match="must not list itself"):
        new_manifest(5, 2, [FileRecord("manifest.json", 1, 1)])


def _committed_step(tmp_path):
    store = open_store(tmp_path / "d")
    m = sample(3)
    for name, rec in m.files.items():
        store.write_bytes(f"{step_dir(3)}/{name}", b"x" * rec.size)
    write_manifest(store, m)
    return store, m


def _failing_once(store, error: Exception):
    info, failed = store.info, []

    def flaky(key):
        if not failed:
            failed.append(key)
            raise error
        return info(key)

    store.info = flaky
    return failed


@pytest.mark.parametrize(
    "error",
    [OSError("HTTP 500 after 5 retries"), ObjectNotFoundError("404 from a proxy")],
    ids=["a-look-that-fails", "a-404-that-heals"],
)
def test_a_look_after_the_commit_that_fails_once_leaves_the_commit_standing(
    tmp_path, error, monkeypatch
):
    """A failed look failed the committed step's save ('unexpected error'); a single 404
    un-committed it and stopped the job with OtherJobError, one job running."""
    monkeypatch.setattr(manifest_module, "GONE_RECHECK_SECONDS", 0.0)
    store, m = _committed_step(tmp_path)
    failed = _failing_once(store, error)
    assert verify_committed_files(store, m, {}) == [] and failed


def test_a_file_deleted_after_the_commit_is_found_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "GONE_RECHECK_SECONDS", 0.0)
    store, m = _committed_step(tmp_path)
    store.delete(f"{step_dir(3)}/__0_0.distcp")  # another job's clean-up, say
    assert verify_committed_files(store, m, {}) == ["__0_0.distcp (gone)"]


def test_no_thread_at_the_interpreters_shutdown_leaves_the_commit_standing(tmp_path, monkeypatch):
    """The loop raised while a save was in flight: the look's thread pool could not
    start, and the committed step was reported as failed and its node copy dropped."""

    def shut(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    store, m = _committed_step(tmp_path)
    monkeypatch.setattr(manifest_module, "ThreadPoolExecutor", shut)
    assert verify_committed_files(store, m, {}) == []
