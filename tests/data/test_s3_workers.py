"""DataLoader workers over s3:// read through the native backend, every byte intact."""

from __future__ import annotations

import hashlib
import os

import pytest

import unbroken as ub


def _digest(data: bytes, path: str) -> tuple[str, str]:
    return path, hashlib.sha256(data).hexdigest()


@pytest.mark.s3
@pytest.mark.multiprocess
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_read_s3_natively_and_every_sample_is_the_source(s3_server, tmp_path, start):
    """Fork: through the parent's relay; spawn: with obstore in the worker itself."""
    root = s3_server.new_root()
    bucket, prefix = root.split("/", 1)
    client = s3_server.client()
    source = {}
    for i in range(48):
        blob = os.urandom(1000 + 97 * i)
        key = f"d{i % 3}/f{i:03d}.bin"
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=blob)
        source[key] = hashlib.sha256(blob).hexdigest()
    ds = ub.VolumeDataset(
        f"s3://{root}", _digest, cache_dir=str(tmp_path / "cache"),
        storage_options=s3_server.native_storage_options,  # s3fs knows none of these
    )  # fmt: skip
    loader = ub.DataLoader(
        ds, batch_size=4, num_workers=2, timeout=120, collate_fn=list,
        multiprocessing_context=start,
    )  # fmt: skip
    for epoch in range(2):  # cold (fetched ahead by this process or by a worker), then warm
        seen = {path: digest for batch in loader for path, digest in batch}
        assert seen == source, f"epoch {epoch}"
