"""The far-remote profile: bytes pass the delay line intact, and each request waits."""

from __future__ import annotations

import os
import time

import unbroken as ub
from bench.common.s3remote import S3Remote


def test_far_profile_keeps_bytes_and_adds_latency(s3_server):
    far = S3Remote.profile("far", s3_server)
    try:
        store = ub.open_store(f"s3://{s3_server.new_root()}", **far.storage_options)
        blob = os.urandom(9 << 20)  # a multipart upload and a streamed response
        store.write_bytes("big", blob)
        assert store.read_bytes("big") == blob
        start = time.perf_counter()
        store.read_bytes("big", 0, 10)
        # a lower bound the delay line guarantees by construction, not a speed claim
        assert time.perf_counter() - start >= far.latency_ms / 1000
        assert far.proxy_cpu_seconds() > 0
    finally:
        far.close()
