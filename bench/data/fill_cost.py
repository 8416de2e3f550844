"""CPU per file of filling the cache from the training process, taken apart.

The fill (``unbroken/data/fill_ahead.py``) fetches each file of a cold epoch and writes it
into the node cache. This measures, in one process against the real S3 server on
loopback, the CPU per file of each layer on its own:
  get          ``store.read_bytes``: the GET alone
  cache fetch  ``LocalCache.fetch``: the GET, the cache's file and its bookkeeping
  disk write   a new file of the same size written and renamed, no S3: what the local
               disk costs the fill on this machine

    python -m bench.data.fill_cost [--files 2000] [--size 100000] [--threads 32] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from unbroken.data.cache.cache import LocalCache
from unbroken.storage import Entry, Store, open_store


def cpu_ms_per_item(
    items: Sequence[object], work: Callable[[object], object], threads: int
) -> float:
    """This process's CPU milliseconds per item of ``work`` over ``items`` on ``threads``.

    Every item is worked once; the first error any thread met is raised, so a fetch that
    fails can never pass for a cheap one."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    todo = iter(range(len(items)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drain() -> None:
        while not errors:
            with lock:
                index = next(todo, None)
            if index is None:
                return
            try:
                work(items[index])
            except BaseException as exc:  # raised below, on the caller's thread
                errors.append(exc)

    started = time.process_time()
    pool = [threading.Thread(target=drain) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return (time.process_time() - started) * 1000 / max(len(items), 1)


def write_new_file(directory: str, index: int, payload: bytes) -> None:
    temp = os.path.join(directory, f".t{index}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)
    os.replace(temp, os.path.join(directory, f"f{index}"))


def measure(store: Store, entries: list[Entry], size: int, threads: int, work_dir: str) -> dict:
    """CPU ms per file of each layer; the disk layers write under ``work_dir`` (put it
    on the disk the cache would use)."""
    rows = {"get": cpu_ms_per_item(entries, lambda e: store.read_bytes(e.key), threads)}
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=work_dir)
    cache = LocalCache(store, cache_dir)
    try:
        rows["cache fetch"] = cpu_ms_per_item(entries, cache.fetch, threads)
        missing = [e.key for e in entries if not cache.contains(e)]
        if missing:
            raise RuntimeError(f"the cache fetch left {len(missing)} files uncached: {missing[:3]}")
    finally:
        cache.close()
        shutil.rmtree(cache_dir)
    disk = tempfile.mkdtemp(prefix="disk-", dir=work_dir)
    payload = os.urandom(size)
    try:
        rows["disk write"] = cpu_ms_per_item(
            range(len(entries)), lambda i: write_new_file(disk, i, payload), threads
        )
    finally:
        shutil.rmtree(disk)
    return rows


def put_files(store: Store, files: int, size: int) -> list[Entry]:
    payload = os.urandom(size)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: store.write_bytes(f"f{i:06d}", payload), range(files)))
    return sorted(store.list(""), key=lambda e: e.key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=100_000, help="bytes per file")
    parser.add_argument("--threads", type=int, default=32, help="the fill's default: 32")
    parser.add_argument(
        "--dir", default=None, help="where the cache and disk layers write (a temp dir)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from bench.common.s3remote import S3Remote

    args = parse_args(argv)
    remote = S3Remote()
    work_dir = tempfile.mkdtemp(prefix="unbroken-fill-cost-", dir=args.dir)
    try:
        store = open_store(f"s3://{remote.new_root()}", **remote.storage_options)
        entries = put_files(store, args.files, args.size)
        print(f"load {os.getloadavg()[0]:.2f}; {len(entries)} files of {args.size} B, "
              f"{args.threads} threads; {remote.describe()}")  # fmt: skip
        for name, ms in measure(store, entries, args.size, args.threads, work_dir).items():
            print(f"  {name:12s} {ms:.3f} CPU ms per file")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        remote.close()


if __name__ == "__main__":
    main()
