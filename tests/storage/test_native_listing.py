"""What the native backend lists: files, never a console's folder markers."""

from __future__ import annotations

import pytest

import unbroken as ub

pytestmark = pytest.mark.s3


def test_a_folder_marker_is_not_listed_but_an_empty_file_is(s3_server, tmp_path):
    """The AWS console's "Create folder" (and s3fs mkdir, rclone) leave an empty
    ``images/`` object: it was listed as a file ``images`` that no read could find, and a
    dataset failed on it at the same sample every epoch, and after every restart."""
    root = s3_server.new_root()
    bucket, prefix = root.split("/", 1)
    client = s3_server.client()
    for key, body in (("images/", b""), ("images/x", b"x"), ("empty", b""), ("top/", b"")):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
    store = ub.open_store(f"s3://{root}", **s3_server.storage_options)
    assert [(e.key, e.size) for e in store.list()] == [("empty", 0), ("images/x", 1)]
    assert [e.key for e in store.list("images")] == ["images/x"]
    dataset = ub.VolumeDataset(
        f"s3://{root}",
        decode=lambda data, key: (key, data),
        storage_options=s3_server.storage_options,
        cache_dir=str(tmp_path / "cache"),
        shuffle=False,
    )
    assert list(dataset) == [("empty", b""), ("images/x", b"x")]
