"""Large transfers stream: moving a file never holds all of it in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MEASURE = textwrap.dedent(
    """
    import json, os, resource, sys
    from unbroken import open_store
    url, options, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    store = open_store(url, **options)
    store.write_bytes("warmup", b"x")  # import and connect before the baseline
    store.read_bytes("warmup")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    store.upload(path, "big.bin")
    after_upload = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    store.download("big.bin", path + ".back")
    after_download = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"upload": after_upload - base, "download": after_download - base}))
    """
)


@pytest.mark.multiprocess
@pytest.mark.s3
def test_s3_upload_and_download_use_bounded_memory(tmp_path, s3_server):
    size = 256 << 20
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        block = os.urandom(8 << 20)
        for _ in range(size // len(block)):
            f.write(block)
    options = {k: v for k, v in s3_server.storage_options.items() if k != "skip_instance_cache"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, f"s3://{s3_server.new_root()}/x", json.dumps(options),
         str(path)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    growth = json.loads(out.stdout)
    # Parts in flight are bounded (8 streams x 8 MiB); the whole file would be 256 MiB.
    assert growth["upload"] < size * 0.6, growth
    assert growth["download"] < size * 0.6, growth
    assert os.path.getsize(str(path) + ".back") == size
