"""Store throughput through the standard emulated remote, 1 and 8 parallel streams.

Later benchmarks are read against these numbers: they say what the link can carry for
large objects (bandwidth-bound) and for small ones (latency-bound).

    python -m bench.storage.store [--quick] [--latency 0.02] [--bandwidth 200MB]
    python -m bench.storage.store --s3 [--quick]   # a real S3 server: unbroken vs boto3 vs s3fs
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import unbroken as ub
from unbroken._util.sizes import format_size, parse_size
from unbroken.storage.link import discard_link


def run_case(store: ub.Store, tmp: str, streams: int, nfiles: int, size: int, op: str) -> float:
    """MB/s moving ``nfiles`` objects of ``size`` bytes with ``streams`` parallel streams."""
    src = os.path.join(tmp, f"src-{size}.bin")
    if not os.path.exists(src):
        with open(src, "wb") as f:
            f.write(os.urandom(size))
    keys = [f"bench/{size}/{i:05d}" for i in range(nfiles)]
    if op == "download":
        with ThreadPoolExecutor(16) as pool:  # seed the objects outside the timed region
            list(pool.map(lambda k: store.inner.upload(src, k), keys))

    def one(key: str) -> None:
        if op == "upload":
            store.upload(src, key)
        else:
            store.download(key, os.path.join(tmp, "dl", key.replace("/", "_")))

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, keys))
    seconds = time.perf_counter() - start
    store.inner.delete("bench")
    return nfiles * size / seconds / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers (~10 s)")
    parser.add_argument("--latency", type=float, default=ub.RemoteProfile().latency)
    parser.add_argument("--bandwidth", default="200MB")
    parser.add_argument(
        "--s3", action="store_true", help="a real S3 server (SeaweedFS): vs boto3 and s3fs"
    )
    args = parser.parse_args()
    if args.s3:
        from bench.storage.store_s3 import print_rows, run

        print_rows(run(args.quick))
        return
    bandwidth = float(parse_size(args.bandwidth))
    profile = ub.RemoteProfile(
        latency=args.latency, bandwidth=bandwidth, link=f"bench-store-{os.getpid()}"
    )
    large = (16 << 20) if args.quick else (64 << 20)
    small = 100_000
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = ub.open_store(f"emulated::{tmp}/remote", **profile.as_options())
        try:
            for op in ("upload", "download"):
                for streams in (1, 8):
                    for size, nfiles in ((large, 2 * streams), (small, 20 * streams)):
                        mbps = run_case(store, tmp, streams, nfiles, size, op)
                        ideal = size / (profile.latency + size / bandwidth) * streams / 1e6
                        ideal = min(ideal, bandwidth / 1e6)
                        rows.append((op, streams, size, mbps, ideal))
        finally:
            discard_link(profile.link)
    print(f"standard remote profile: {profile.describe()}")
    print(
        f"{'op':<9} {'streams':>7} {'object size':>11} {'MB/s':>8} {'link allows MB/s':>16} "
        f"{'of that':>7}"
    )
    for op, streams, size, mbps, ideal in rows:
        obj = format_size(size)
        print(f"{op:<9} {streams:>7} {obj:>11} {mbps:>8.1f} {ideal:>16.1f} {mbps / ideal:>7.0%}")
    summary = {
        f"{op}_{streams}x_{'large' if size == large else 'small'}_mbps": round(mbps, 1)
        for op, streams, size, mbps, _ in rows
    }
    summary.update(latency_s=profile.latency, bandwidth_mbps=bandwidth / 1e6)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
