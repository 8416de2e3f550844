"""Bad bytes never reach the caller: flipped, short, missing files and hostile pickles."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch

from tests.checkpoint.format_util import assert_same, load_from, publish, save_step
from unbroken import open_store
from unbroken.checkpoint.errors import CheckpointCorruptError
from unbroken.checkpoint.format.dcp_json import metadata_from_json
from unbroken.checkpoint.format.manifest import (
    FileRecord,
    Manifest,
    crc32c_bytes,
    crc32c_file,
    step_dir,
)
from unbroken.checkpoint.format.tensor_record import raw_view
from unbroken.checkpoint.staging.copy import buffer_key

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


class Hostile:
    """Unpickling this creates a directory: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def state() -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7), "meta": {"k": 1}}


def blank() -> dict:
    return {"w": torch.zeros(4096), "b": torch.zeros(7), "meta": {"k": 0}}


def committed(tmp_path, store, sd=None, step=9):
    directory, manifest = save_step(tmp_path / "stage", step, sd or state())
    publish(directory, store, manifest)
    return directory, manifest


def payload_of(directory, fqn: str):
    md = metadata_from_json((directory / "metadata.json").read_bytes(), where="metadata.json")
    return next(loc for idx, loc in md.storage_data.items() if idx.fqn == fqn)


def rewrite(store, step: int, name: str, edit) -> None:
    key = f"{step_dir(step)}/{name}"
    store.write_bytes(key, edit(bytearray(store.read_bytes(key))))


def test_flipped_byte_in_a_tensor_is_detected(store, tmp_path):
    directory, manifest = committed(tmp_path, store)
    loc = payload_of(directory, "w")

    def flip(data):
        data[loc.payload_offset + 1000] ^= 0x01
        return data

    rewrite(store, 9, SHARD, flip)
    with pytest.raises(CheckpointCorruptError) as info:
        load_from(store, manifest, blank())
    err = info.value
    assert err.step == 9 and err.file == SHARD
    assert SHARD in str(err) and "crc32c mismatch" in str(err) and "step 9" in str(err)
    assert err.url == store.url_for(f"{step_dir(9)}/{SHARD}")


def test_a_checksum_taken_while_staging_is_written_as_is_and_a_wrong_one_is_caught(tmp_path):
    """The shard writer records a payload checksum the staging copy took without reading
    the bytes again. The right one gives the very shard a plain save gives; a wrong one
    (a bug in staging) fails the load, instead of restoring bytes nobody checked."""
    sd = state()
    w = raw_view(sd["w"])
    key = buffer_key(w.ctypes.data, w.nbytes)
    right = crc32c_bytes(memoryview(w))
    _, plain = save_step(tmp_path / "plain", 9, sd)
    _, known = save_step(tmp_path / "known", 9, sd, known_checksums={key: right})
    assert known.files[SHARD] == plain.files[SHARD]  # (the metadata names its directory)
    directory, wrong = save_step(tmp_path / "wrong", 9, sd, known_checksums={key: right ^ 1})
    assert wrong.files[SHARD].crc32c != plain.files[SHARD].crc32c
    store = open_store(tmp_path / "durable")
    publish(directory, store, wrong)
    with pytest.raises(CheckpointCorruptError, match="crc32c") as info:
        load_from(store, wrong, blank())
    assert info.value.file == SHARD and info.value.step == 9


def test_without_verify_a_flip_goes_unnoticed(tmp_path):
    store = open_store(tmp_path / "durable")
    directory, manifest = committed(tmp_path, store)
    loc = payload_of(directory, "b")

    def flip(data):
        data[loc.payload_offset + 3] ^= 0x80  # sign bit of b[0] (little-endian)
        return data

    rewrite(store, 9, SHARD, flip)
    out = load_from(store, manifest, blank(), verify=False)
    assert out["b"][0].item() == -1.0


def test_flipped_byte_in_a_bytes_value_is_detected_before_unpickling(tmp_path):
    store = open_store(tmp_path / "durable")
    directory, manifest = committed(tmp_path, store)
    loc = payload_of(directory, "meta.k")

    def flip(data):
        data[loc.payload_offset + loc.payload_length // 2] ^= 0xFF
        return data

    rewrite(store, 9, SHARD, flip)
    with pytest.raises(CheckpointCorruptError, match="crc32c mismatch"):
        load_from(store, manifest, blank())


def test_corrupt_metadata_json_is_detected(tmp_path):
    store = open_store(tmp_path / "durable")
    _, manifest = committed(tmp_path, store)

    def flip(data):
        data[len(data) // 2] ^= 0x01
        return data

    rewrite(store, 9, "metadata.json", flip)
    with pytest.raises(CheckpointCorruptError, match=r"metadata\.json.*crc32c") as info:
        load_from(store, manifest, blank())
    assert info.value.file == "metadata.json"


@pytest.mark.parametrize("cut", [1, 4000])
def test_truncated_shard_is_detected(tmp_path, cut):
    store = open_store(tmp_path / "durable")
    _, manifest = committed(tmp_path, store)
    rewrite(store, 9, SHARD, lambda data: data[:-cut])
    with pytest.raises(CheckpointCorruptError, match=f"{SHARD}.*short file"):
        load_from(store, manifest, blank())


def test_missing_shard_is_detected(store, tmp_path):
    _, manifest = committed(tmp_path, store)
    store.delete(f"{step_dir(9)}/{SHARD}")
    with pytest.raises(CheckpointCorruptError, match=f"{SHARD}.*missing"):
        load_from(store, manifest, blank())


def test_hostile_metadata_pickle_is_never_opened(tmp_path):
    """A .metadata that would run code on unpickling: our reader never reads it."""
    marker = tmp_path / "pwned-metadata"
    directory, _ = save_step(tmp_path / "stage", 9, state())
    (directory / ".metadata").write_bytes(pickle.dumps(Hostile(str(marker))))
    # Re-make the manifest so that the hostile file is even listed as legitimate.
    files = {
        p.name: FileRecord(p.name, p.stat().st_size, crc32c_file(p)) for p in directory.iterdir()
    }
    manifest = Manifest(9, 1, files, "test", torch.__version__, 0.0, {})
    store = open_store(tmp_path / "durable")
    publish(directory, store, manifest)
    out = load_from(store, manifest, blank())
    assert_same(out, state())
    assert not marker.exists()


def test_hostile_value_is_refused_at_save_time(tmp_path):
    """A value weights_only cannot load would make the checkpoint unrestorable: fail now."""
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp_path / "pwned-save"
    with pytest.raises(CheckpointException, match=r"'evil' could not be restored safely"):
        save_step(tmp_path / "stage", 9, {"w": torch.ones(3), "evil": Hostile(str(marker))})
    assert not marker.exists()


def plant_value(directory, fqn: str, payload: bytes) -> Manifest:
    """An attacker with write access: append ``payload`` to the shard, point ``fqn`` at it,
    and fix every checksum (metadata.json, manifest) so that all of them agree."""
    shard = directory / SHARD
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    doc = json.loads((directory / "metadata.json").read_bytes())
    entry = next(e for e in doc["storage_data"] if e["fqn"] == fqn)
    entry.update(
        record=[offset, len(payload)], payload=[offset, len(payload)], crc32c=crc32c_bytes(payload)
    )
    (directory / "metadata.json").write_bytes(json.dumps(doc).encode())
    files = {
        p.name: FileRecord(p.name, p.stat().st_size, crc32c_file(p)) for p in directory.iterdir()
    }
    return Manifest(9, 1, files, "test", torch.__version__, 0.0, {})


def test_hostile_value_with_valid_checksums_is_refused_not_executed(store, tmp_path):
    marker = tmp_path / "pwned-value"
    directory, _ = save_step(tmp_path / "stage", 9, {"w": torch.ones(3), "evil": 0})
    hostile = io.BytesIO()
    torch.save(Hostile(str(marker)), hostile)
    manifest = plant_value(directory, "evil", hostile.getvalue())
    publish(directory, store, manifest)
    with pytest.raises(CheckpointCorruptError, match=r"'evil'.*weights_only") as info:
        load_from(store, manifest, {"w": torch.zeros(3), "evil": None})
    assert info.value.file == SHARD and "GLOBAL posix.mkdir" in str(info.value)
    assert not marker.exists()


def test_file_not_in_manifest_is_refused(tmp_path):
    """metadata.json points at a shard the manifest does not list: not loaded."""
    store = open_store(tmp_path / "durable")
    _, manifest = committed(tmp_path, store)
    files = {k: v for k, v in manifest.files.items() if k != SHARD}
    from dataclasses import replace

    partial = replace(manifest, files=files)
    with pytest.raises(CheckpointCorruptError, match=f"{SHARD}.*not in the manifest"):
        load_from(store, partial, blank())


def test_failed_save_leaves_no_file_behind(tmp_path):
    """A value that cannot be serialized fails the save midway: no shard, no temp file."""
    from torch.distributed.checkpoint.api import CheckpointException

    directory = tmp_path / "stage"
    sd = {"a": torch.ones(1000), "bad": lambda: None, "z": torch.ones(3)}
    with pytest.raises(CheckpointException):
        save_step(directory, 4, sd)
    assert list((directory / step_dir(4)).iterdir()) == []


def test_writer_refuses_to_overwrite_a_committed_checkpoint(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    store = open_store(tmp_path / "durable")
    directory, manifest = committed(tmp_path, store)
    (directory / "manifest.json").write_bytes(manifest.to_json())
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(CheckpointException, match="refusing to write over it"):
        save_step(tmp_path / "stage", 9, {"w": torch.zeros(4096)})
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_numpy_array_value_is_refused_at_save_time_with_the_global_named(tmp_path):
    """np.random.get_state() holds an ndarray: weights_only refuses it, so the save does."""
    import numpy as np
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"'np_rng'.*numpy"):
        save_step(tmp_path / "stage", 9, {"np_rng": np.random.get_state()})


@pytest.mark.parametrize(
    ("target", "named"),
    [
        ({"w": torch.zeros(5), "b": torch.zeros(7), "meta": {"k": 0}}, r"torch.Size\(\[4096\]\)"),
        ({**blank(), "extra": torch.zeros(2)}, "extra"),
    ],
)
def test_key_or_shape_mismatch_is_a_mismatch_error_naming_it(tmp_path, target, named):
    from unbroken.checkpoint.errors import CheckpointMismatchError

    store = open_store(tmp_path / "durable")
    _, manifest = committed(tmp_path, store)
    with pytest.raises(CheckpointMismatchError, match=rf"step 9: .*{named}"):
        load_from(store, manifest, target)
