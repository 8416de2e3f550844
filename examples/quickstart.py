"""The storage layer on its own: writes through a faulty emulated remote all land.

Writes a few objects through the emulated standard remote profile (20 ms per request,
200 MB/s shared link) with 10% of requests failing transiently, then reads them back
and checks every byte. The full training demo is `unbroken demo` (`make demo`).
"""

from __future__ import annotations

import os
import tempfile
import time

import unbroken as ub


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        remote = ub.open_store(f"emulated::{root}/remote", fail_rate=0.1, link="quickstart")
        payloads = {f"objects/{i:03d}.bin": os.urandom(256 << 10) for i in range(32)}
        start = time.perf_counter()
        for key, data in payloads.items():
            remote.write_bytes(key, data)
        wrote = time.perf_counter() - start
        listed = remote.list("objects")
        assert [e.key for e in listed] == sorted(payloads), "listing is incomplete"
        for key, data in payloads.items():
            assert remote.read_bytes(key) == data, f"{key} came back different"
        total = sum(len(d) for d in payloads.values())
        print(f"remote profile: {remote.profile.describe()}")
        print(
            f"wrote {len(payloads)} objects ({total / 1e6:.1f} MB) in {wrote:.2f}s through "
            f"{remote.faults_injected} injected faults ({remote.stats.retries} retries); "
            "all read back intact"
        )


if __name__ == "__main__":
    main()
