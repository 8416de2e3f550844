"""Raw store speed over a real S3 server (SeaweedFS on loopback): unbroken's native
backend against boto3 and s3fs on the same objects, side by side.

Rows: small objects (GET/s, 1 and 16 threads) and one large object (upload and download
MB/s). All three clients run in this process against the same server, one at a time.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import unbroken as ub
from tests.s3server import S3Server


def _rate(count: int, threads: int, fn: Callable[[int], object]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(count)))
    return count / (time.perf_counter() - start)


def run(quick: bool) -> list[tuple[str, str, float, float, float]]:
    """(what, unit, unbroken, boto3, s3fs) rows."""
    from boto3.s3.transfer import TransferConfig

    nsmall, small = (300, 100_000) if quick else (1000, 100_000)
    large = (64 << 20) if quick else (256 << 20)
    server = S3Server()
    try:
        root = server.new_root()
        bucket, prefix = root.split("/", 1)
        opts = server.storage_options
        native = ub.open_store(f"s3://{root}", **opts)
        fsspec_store = ub.open_store(f"s3://{root}", backend="fsspec", **opts)
        s3fs = fsspec_store.fs  # type: ignore[attr-defined]
        client = server.client()
        blob = os.urandom(small)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: native.write_bytes(f"small/{i:05d}", blob), range(nsmall)))
        rows = []
        for threads in (1, 16):
            rows.append(
                (
                    f"GET {small // 1000} KB objects, {threads} thread(s)",
                    "GET/s",
                    _rate(nsmall, threads, lambda i: native.read_bytes(f"small/{i:05d}")),
                    _rate(
                        nsmall,
                        threads,
                        lambda i: client.get_object(Bucket=bucket, Key=f"{prefix}/small/{i:05d}")[
                            "Body"
                        ].read(),
                    ),
                    _rate(
                        nsmall,
                        threads,
                        lambda i: s3fs.cat_file(f"{bucket}/{prefix}/small/{i:05d}"),
                    ),
                )
            )
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "big.bin")
            with open(src, "wb") as f:
                for _ in range(large >> 20):
                    f.write(os.urandom(1 << 20))
            mb = large / 1e6
            config = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=8)

            def timed(fn: Callable[[], object]) -> float:
                start = time.perf_counter()
                fn()
                return mb / (time.perf_counter() - start)

            rows.append(
                (
                    f"upload {large >> 20} MiB (multipart)",
                    "MB/s",
                    timed(lambda: native.upload(src, "big/native")),
                    timed(
                        lambda: client.upload_file(
                            src, bucket, f"{prefix}/big/boto3", Config=config
                        )
                    ),
                    timed(lambda: fsspec_store.upload(src, "big/s3fs")),
                )
            )
            dst = os.path.join(tmp, "back.bin")
            rows.append(
                (
                    f"download {large >> 20} MiB (ranged)",
                    "MB/s",
                    timed(lambda: native.download("big/native", dst)),
                    timed(
                        lambda: client.download_file(
                            bucket, f"{prefix}/big/boto3", dst, Config=config
                        )
                    ),
                    timed(lambda: fsspec_store.download("big/s3fs", dst)),
                )
            )
        return rows
    finally:
        server.close()


def print_rows(rows: list[tuple[str, str, float, float, float]]) -> None:
    print(f"{'real S3 (SeaweedFS, loopback)':40} {'unit':>6} {'unbroken':>9} "
          f"{'boto3':>9} {'s3fs':>9}")  # fmt: skip
    for what, unit, mine, boto, s3fs in rows:
        print(f"{what:40} {unit:>6} {mine:9.0f} {boto:9.0f} {s3fs:9.0f}")
