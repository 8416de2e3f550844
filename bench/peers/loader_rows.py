"""One row of bench/peers/loaders.py, run in its own interpreter (the peers' virtualenv).

    python -m bench.peers.loader_rows SPEC.json      -> one JSON line: the row's measurements
    python -m bench.peers.loader_rows SPEC.json rank -> one rank of a resume at another world size

Each row builds its loader over the same S3 server, the same JPEGs, the same
:func:`bench.common.jpeg_workload.decode`, batch size and worker count; every sample comes with the
CRC-32 of the raw bytes it was decoded from and the key it claims to be, so the parent
can count duplicates, missing samples and wrong bytes (:mod:`bench.peers.accounting`).
A row's imports (streaming, litdata, torchdata) stay in its own process.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

from bench.common.jpeg_workload import Epoch, decode
from bench.common.paths import module_argv
from bench.peers.accounting import account, crc_of, delivered_of_batch

ROWS = ("stock", "unbroken", "stateful", "streaming", "litdata", "litdata_raw")


# -- what every row shares ---------------------------------------------------------------


def sample(data: bytes, key: str) -> tuple[torch.Tensor, int, str]:
    """The decoded image, the CRC of the bytes it came from, and its key."""
    return decode(data, key), crc_of(data), key


class DiskPeak:
    """The largest size a cache folder reached, sampled by a thread while a run goes on.

    A walk of a cache of one file per sample costs about 7 ms of CPU at 1,280 files and
    grows with the files: ``cpu_seconds`` (this thread's own) is taken out of the
    loader's CPU, and the walks are spaced to keep the thread busy at most ``duty`` of
    the time, since what they cost the loader's other threads (the GIL, a core of two)
    cannot be taken out: at ten walks a second, a cache of 10,000 files slowed the one
    row that caches per file by its own measurement."""

    def __init__(self, folder: str | None, every: float = 0.1, duty: float = 0.02) -> None:
        self.folder, self.every, self.duty, self.peak = folder, every, duty, 0
        self.cpu_seconds = 0.0
        self.walks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-peak", daemon=True)
        if folder:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started, wall = time.thread_time(), time.perf_counter()
            self.peak = max(self.peak, folder_bytes(self.folder))
            self.cpu_seconds += time.thread_time() - started
            self.walks += 1
            self._stop.wait(max(self.every, (time.perf_counter() - wall) / self.duty))

    def stop(self) -> int:
        if self.folder:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, folder_bytes(self.folder))
        return self.peak


def folder_bytes(folder: str | None) -> int:
    """Bytes of every file under ``folder`` (0 if it does not exist yet)."""
    total = 0
    for root, _dirs, files in os.walk(folder or "", onerror=lambda _e: None):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


class Tally:
    """A loader wrapped so that each batch's ``(key, crc)`` pairs are kept."""

    def __init__(self, loader: Any, limit: int | None = None) -> None:
        self.loader, self.limit, self.delivered = loader, limit, []

    def __iter__(self):
        if self.limit == 0:
            return
        for i, batch in enumerate(self.loader, 1):
            self.delivered += delivered_of_batch(batch)
            yield batch[0]
            if i == self.limit:  # stop without asking for one more: it would count as read
                return


@dataclass
class Built:
    """A loader and what the row knows about it."""

    loader: Any
    cache_dir: str | None
    stateful: bool


# -- the rows ------------------------------------------------------------------------------


def s3_client(spec: dict) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=spec["endpoint"], region_name="us-east-1",
        aws_access_key_id=spec["key"], aws_secret_access_key=spec["secret"],
    )  # fmt: skip


class BotoFiles(torch.utils.data.Dataset):
    """What a user writes without a data library: boto3 ``get_object`` per item."""

    def __init__(self, spec: dict, keys: list[str]) -> None:
        self.spec, self.keys = spec, keys
        self.bucket, self.prefix = spec["files"].split("/", 1)
        self._client: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        if self._client is None or self._client[0] != os.getpid():  # one client per worker
            self._client = (os.getpid(), s3_client(self.spec))
        key = self.keys[i]
        body = self._client[1].get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"]
        return sample(body.read(), key)


def _sampler(spec: dict, n: int, rank: int, world: int) -> torch.utils.data.Sampler:
    """The shuffle a user of the stock loader writes: DistributedSampler, seed 0."""
    return torch.utils.data.DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )


def build_stock(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    ds = BotoFiles(spec, spec["keys"])
    loader = torch.utils.data.DataLoader(
        ds, batch_size=spec["batch_size"], sampler=_sampler(spec, len(ds), rank, world),
        num_workers=workers, drop_last=True,
    )  # fmt: skip
    return Built(loader, None, stateful=False)


def build_stateful(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = BotoFiles(spec, spec["keys"])
    loader = StatefulDataLoader(
        ds, batch_size=spec["batch_size"], sampler=_sampler(spec, len(ds), rank, world),
        num_workers=workers, drop_last=True,
    )  # fmt: skip
    return Built(loader, None, stateful=True)


def build_unbroken(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    import unbroken as ub

    run = os.path.join(spec["work"], f"unbroken-{tag}-rank{rank}")
    options = {
        "key": spec["key"], "secret": spec["secret"], "endpoint_url": spec["endpoint"],
        "client_kwargs": {"region_name": "us-east-1"},
    }  # fmt: skip
    ds = ub.VolumeDataset(
        f"s3://{spec['files']}", sample, cache_dir=os.path.join(run, "cache"),
        index_dir=os.path.join(run, "index"), storage_options=options, include="*.jpg",
        seed=0, rank=rank, world_size=world,
    )  # fmt: skip
    loader = ub.DataLoader(ds, batch_size=spec["batch_size"], num_workers=workers)
    return Built(loader, os.path.join(run, "cache"), stateful=True)


def import_streaming_base() -> types.ModuleType:
    """``streaming.base`` without the package's ``__init__``.

    ``import streaming`` imports ``streaming.vision``, which imports torchvision, and no
    torchvision wheel on PyPI imports beside a CPU torch 2.13 (each links
    libtorch_cuda.so). The loader, writer and dataset this benchmark uses live in
    ``streaming.base``, which never imports torchvision, so the peers' venv has none.
    """
    if "streaming" not in sys.modules:
        found = importlib.util.find_spec("streaming")
        if found is None or not found.submodule_search_locations:
            raise ModuleNotFoundError("mosaicml-streaming is not installed in this venv")
        package = types.ModuleType("streaming")
        package.__path__ = list(found.submodule_search_locations)
        sys.modules["streaming"] = package
    import streaming.base

    return streaming.base


def streaming_env(spec: dict) -> None:
    os.environ.update(
        S3_ENDPOINT_URL=spec["endpoint"], AWS_ACCESS_KEY_ID=spec["key"],
        AWS_SECRET_ACCESS_KEY=spec["secret"], AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip


class _RetriesOnly(logging.Filter):
    """botocore's records of a failed request and of its retry, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage().startswith(("Retry needed", "Exception received"))


def log_boto_retries() -> None:
    """Say on stderr (the run's log) each request botocore retries, and why, with the
    time: Streaming's client waits 60 s (its read timeout) on a request that stalls, and a
    first batch of about 63 s was seen on the far profile. Streaming sends a few requests
    per shard, so the unkept debug records cost nothing measurable."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(message)s"))
    handler.addFilter(_RetriesOnly())
    for name in ("botocore.endpoint", "botocore.retries.standard"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)


def build_streaming(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    streaming_env(spec)
    log_boto_retries()
    base = import_streaming_base()

    class Decoded(base.StreamingDataset):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
            record = super().__getitem__(i)
            return sample(record["jpeg"], record["key"])

    base.util.clean_stale_shared_memory()
    local = os.path.join(spec["work"], f"streaming-{tag}")  # one per node, as documented
    ds = Decoded(
        remote=f"s3://{spec['mds']}", local=local, shuffle=True, shuffle_seed=0,
        batch_size=spec["batch_size"],
    )  # fmt: skip
    loader = base.StreamingDataLoader(
        ds, batch_size=spec["batch_size"], num_workers=workers, drop_last=True
    )
    return Built(loader, local, stateful=True)


def litdata_options(spec: dict) -> dict:
    """Only the endpoint: LitData hands these to boto3 *and* to s3fs (the raw dataset's
    listing), whose option names differ; the credentials go by the env both read."""
    os.environ.update(
        AWS_ACCESS_KEY_ID=spec["key"], AWS_SECRET_ACCESS_KEY=spec["secret"],
        AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    return {"endpoint_url": spec["endpoint"]}


def litdata_env() -> None:
    """Let LitData's obstore path (its fast one) talk to an ``http://`` endpoint.

    LitData builds its obstore ``S3Store`` with client options of its own, and explicit
    client options replace the environment's (``AWS_ALLOW_HTTP`` is ignored then): the
    only way ``allow_http`` reaches it is LitData's module-level options. On real S3
    (https) nothing is changed; here the benchmark server speaks http.
    """
    import litdata.streaming.downloader as downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]


def build_litdata(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    litdata_env()
    import litdata

    class Decoded(litdata.StreamingDataset):
        def __getitem__(self, i: Any) -> tuple[torch.Tensor, int, str]:
            record = super().__getitem__(i)
            return sample(record["jpeg"], record["key"])

    cache = os.path.join(spec["work"], f"litdata-{tag}")
    ds = Decoded(
        f"s3://{spec['litdata']}", cache_dir=cache, shuffle=True, seed=0, drop_last=True,
        storage_options=litdata_options(spec),
    )  # fmt: skip
    loader = litdata.StreamingDataLoader(ds, batch_size=spec["batch_size"], num_workers=workers)
    return Built(loader, cache, stateful=True)


def build_litdata_raw(spec: dict, workers: int, rank: int, world: int, tag: str) -> Built:
    litdata_env()
    from litdata import StreamingRawDataset

    root = f"s3://{spec['raw']}/"

    class Decoded(StreamingRawDataset):
        def _keyed(self, indices: list[int], raw: list[bytes]) -> list[tuple]:
            return [
                sample(data, self.items[i].path[len(root):])
                for i, data in zip(indices, raw)
            ]  # fmt: skip

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
            return self._keyed([i], [super().__getitem__(i)])[0]

        def __getitems__(self, indices: list[int]) -> list[tuple]:
            return self._keyed(indices, super().__getitems__(indices))

    cache = os.path.join(spec["work"], f"litdata-raw-{tag}")
    ds = Decoded(root, cache_dir=cache, storage_options=litdata_options(spec))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=spec["batch_size"], sampler=_sampler(spec, len(ds), rank, world),
        num_workers=workers, drop_last=True,
    )  # fmt: skip
    return Built(loader, cache, stateful=False)


BUILDERS: dict[str, Callable[..., Built]] = {
    "stock": build_stock,
    "unbroken": build_unbroken,
    "stateful": build_stateful,
    "streaming": build_streaming,
    "litdata": build_litdata,
    "litdata_raw": build_litdata_raw,
}


# -- conversion: what Streaming and LitData need before the first epoch --------------------


def _read_source(spec: dict, keys: list[str]) -> Callable[[str], bytes]:
    bucket, prefix = spec["files"].split("/", 1)
    local = threading.local()

    def read(key: str) -> bytes:
        if getattr(local, "client", None) is None:
            local.client = s3_client(spec)
        return local.client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()

    return read


def convert_streaming(spec: dict) -> None:
    """The source files (read from S3) -> MDS shards uploaded to ``s3://{spec['mds']}``."""
    from concurrent.futures import ThreadPoolExecutor

    streaming_env(spec)
    base = import_streaming_base()
    read = _read_source(spec, spec["keys"])
    out = (os.path.join(spec["work"], "mds-out"), f"s3://{spec['mds']}")
    columns = {"key": "str", "jpeg": "bytes"}
    with (
        ThreadPoolExecutor(16) as pool,
        base.MDSWriter(out=out, columns=columns, size_limit="64mb", keep_local=False) as writer,
    ):
        for key, data in zip(spec["keys"], pool.map(read, spec["keys"])):
            writer.write({"key": key, "jpeg": data})


_LITDATA_SPEC: dict = {}


def _litdata_record(key: str) -> dict:
    """One sample for ``litdata.optimize``: its key and its raw bytes, read from S3."""
    reader = _LITDATA_SPEC.setdefault("reader", _read_source(_LITDATA_SPEC, []))
    return {"key": key, "jpeg": reader(key)}


def convert_litdata(spec: dict) -> None:
    """The source files (read from S3) -> LitData chunks in ``s3://{spec['litdata']}``."""
    litdata_env()
    import litdata

    _LITDATA_SPEC.clear()
    _LITDATA_SPEC.update(spec)
    litdata.optimize(
        fn=_litdata_record, inputs=list(spec["keys"]), output_dir=f"s3://{spec['litdata']}",
        chunk_bytes="64MB", num_workers=spec["workers"], storage_options=litdata_options(spec),
        verbose=False, start_method="fork",
    )  # fmt: skip


CONVERTERS: dict[str, Callable[[dict], None]] = {
    "streaming": convert_streaming,
    "litdata": convert_litdata,
}


# -- the measurements ----------------------------------------------------------------------


def other_workers(workers: int) -> int:
    """The worker count a resume switches to: fewer where there are several, else two."""
    return 1 if workers > 1 else 2


def close(built: Built) -> None:
    """Stop a loader's workers before the next one starts (as a restarted job would)."""
    it = getattr(built.loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    built.loader = None
    import gc

    gc.collect()


def first_part(spec: dict, build: Callable[..., Built], tag: str) -> tuple[list, Any]:
    """Half an epoch at the run's worker count, then the loader's saved state."""
    built = build(spec, spec["workers"], 0, 1, tag)
    batches = len(spec["keys"]) // spec["batch_size"]
    tally = Tally(built.loader, limit=batches // 2)
    for _ in tally:
        pass
    state = built.loader.state_dict()
    close(built)
    return tally.delivered, state


def resumed_part(
    spec: dict, build: Callable[..., Built], state: Any, workers: int, rank: int, world: int,
    tag: str,
) -> list:  # fmt: skip
    """The rest of the epoch from ``state``, at another worker count or world size."""
    built = build(spec, workers, rank, world, tag)
    built.loader.load_state_dict(state)
    tally = Tally(built.loader)
    for _ in tally:
        pass
    close(built)
    return tally.delivered


def measure_resume(spec: dict, build: Callable[..., Built], stateful: bool) -> dict:
    """Save mid-epoch; resume at another worker count, and (apart) at world size 2.

    The save and both resumes share one cache folder, as a job restarted on the same
    machine does (LitData refuses a state saved with another cache path).
    """
    source = spec["source_crcs"]
    if not stateful:
        return {"resume_workers": "no state", "resume_world": "no state"}
    try:
        before, state = first_part(spec, build, "resume")
    except Exception as exc:
        return {"resume_workers": failure(exc), "resume_world": "not tried"}
    out: dict[str, Any] = {}
    try:
        workers = other_workers(spec["workers"])
        after = resumed_part(spec, build, state, workers, 0, 1, "resume")
        out["resume_workers"] = account(before + after, source).as_dict()
    except Exception as exc:  # a peer that cannot resume this way says so in the table
        out["resume_workers"] = failure(exc)
    try:
        after = resume_at_world(spec, state, 2)
        out["resume_world"] = account(before + after, source).as_dict()
    except Exception as exc:
        out["resume_world"] = failure(exc)
    return out


def failure(exc: BaseException) -> str:
    """A short cell for the table; the whole traceback goes to the row's log (stderr)."""
    import traceback

    traceback.print_exc(file=sys.stderr)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not message:  # a bare assert: its source line says what was refused
        frames = traceback.extract_tb(exc.__traceback__)
        message = frames[-1].line or "" if frames else ""
    return f"error: {type(exc).__name__}: {message[:120]}".rstrip(": ")


def resume_at_world(spec: dict, state: Any, world: int) -> list:
    """One process per rank (RANK/WORLD_SIZE and a gloo group, as torchrun gives)."""
    import pickle
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state_path = os.path.join(spec["work"], "resume-state.pkl")
    with open(state_path, "wb") as f:
        pickle.dump(state, f)
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        out = os.path.join(spec["work"], f"rank{rank}.json")
        procs.append((out, subprocess.Popen(
            module_argv("bench.peers.loader_rows", spec["spec_path"], "rank", state_path, out),
            env=env,
        )))  # fmt: skip
    delivered: list = []
    failed = []
    for out, proc in procs:
        if proc.wait(timeout=600) != 0:
            failed.append(proc.returncode)
            continue
        with open(out) as f:
            delivered += [tuple(d) for d in json.load(f)]
    if failed:
        raise RuntimeError(f"rank processes exited {failed}")
    return delivered


def run_rank(spec: dict, state_path: str, out: str) -> None:
    import pickle

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with open(state_path, "rb") as f:
            state = pickle.load(f)
        build = BUILDERS[spec["row"]]
        delivered = resumed_part(spec, build, state, spec["workers"], rank, world, "resume")
        with open(out, "w") as f:
            json.dump(delivered, f)
    finally:
        dist.destroy_process_group()


def measure(spec: dict) -> dict:
    """Conversion, epochs 1 and 2, peak cache, the byte check; then the resume columns."""
    row = spec["row"]
    result: dict[str, Any] = {"row": row, "conversion_s": None}
    if row in CONVERTERS and spec.get("convert", True):
        started = time.perf_counter()
        CONVERTERS[row](spec)
        result["conversion_s"] = round(time.perf_counter() - started, 2)
    build = BUILDERS[row]
    built = build(spec, spec["workers"], 0, 1, "bench")
    peak = DiskPeak(built.cache_dir)
    tally = Tally(built.loader)
    sampler = {"disk sampler": lambda: peak.cpu_seconds}
    e1 = Epoch(tally, sampler)
    epochs = [e1]
    if spec.get("epochs", 2) > 1:
        epochs.append(Epoch(Tally(built.loader), sampler))
    result["peak_cache_bytes"] = peak.stop()
    for n, e in enumerate(epochs, 1):
        result[f"epoch{n}"] = {
            "images": e.images, "seconds": round(e.seconds, 3), "rate": round(e.rate, 1),
            "first_batch_s": round(e.first_batch, 3), "cpu_ms": round(e.cpu_ms, 3),
            "own_cpu_ms": round(e.own_ms - e.outside_ms["disk sampler"], 3),
        }  # fmt: skip
    result["epoch_check"] = account(tally.delivered, spec["source_crcs"]).as_dict()
    stateful = built.stateful
    close(built)
    if spec.get("resume", True):
        result.update(measure_resume(spec, build, stateful))
    return result


def main() -> None:
    spec_path = sys.argv[1]
    with open(spec_path) as f:
        spec = json.load(f)
    spec["spec_path"] = spec_path
    os.makedirs(spec["work"], exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[2] == "rank":
        run_rank(spec, sys.argv[3], sys.argv[4])
        return
    try:
        result = measure(spec)
    except Exception as exc:
        result = {"row": spec["row"], "error": failure(exc)[len("error: ") :]}
        keep_failed(spec)
    finally:
        if spec.get("clean", True):
            shutil.rmtree(spec["work"], ignore_errors=True)
    print("ROW " + json.dumps(result), flush=True)


def keep_failed(spec: dict) -> str | None:
    """A failed row's files (a peer's local shards, its cache) moved to
    ``spec["failed_dir"]``, the newest failure of each row only, so a wrong sample can be
    compared with its source afterwards. The path is said on stderr (the run's log)."""
    if not spec.get("failed_dir") or not os.path.isdir(spec["work"]):
        return None
    for old in glob.glob(os.path.join(spec["failed_dir"], f"{spec['row']}-*")):
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(spec["failed_dir"], exist_ok=True)
    kept = os.path.join(spec["failed_dir"], os.path.basename(spec["work"]))
    shutil.move(spec["work"], kept)
    print(f"the failed row's files are kept in {kept}", file=sys.stderr, flush=True)
    if spec["row"] == "streaming":
        try:  # evidence only: the row's own result must still be printed
            lines = compare_shards(kept, spec)
        except Exception as e:
            lines = [f"the kept shards could not be compared with the server's: {failure(e)}"]
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    return kept


def compare_shards(kept: str, spec: dict) -> list[str]:
    """Each kept shard against the objects on the server, while the server still runs: is
    it the object it is named after, another shard's bytes, or neither. Says whether a
    wrong sample was wrong on the server or went wrong on its way to the worker."""
    import boto3  # Streaming's own client: in the peers' virtualenv

    client = boto3.client(
        "s3", endpoint_url=spec["endpoint"], aws_access_key_id=spec["key"],
        aws_secret_access_key=spec["secret"], region_name="us-east-1",
    )  # fmt: skip
    bucket, _, prefix = spec["mds"].partition("/")
    keys = {
        os.path.basename(obj["Key"]): obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for obj in page.get("Contents", [])
        if obj["Key"].endswith(".mds")
    }

    def get(key: str, head: bool = False) -> bytes:
        extra = {"Range": f"bytes=0-{(1 << 16) - 1}"} if head else {}
        return client.get_object(Bucket=bucket, Key=key, **extra)["Body"].read()

    heads = {name: get(key, head=True) for name, key in keys.items()}
    lines = []
    for path in sorted(glob.glob(os.path.join(kept, "**", "*.mds"), recursive=True)):
        with open(path, "rb") as f:
            local = f.read()
        name = os.path.basename(path)
        theirs = get(keys[name]) if name in keys else b""  # one whole object at a time
        if theirs == local:
            lines.append(f"{name}: bitwise the server's object")
            continue
        like = [n for n, head in heads.items() if head == local[: 1 << 16]]
        lines.append(
            f"{name}: differs from the server's object ({len(local)} bytes against "
            f"{len(theirs)}, first differing byte {_first_difference(local, theirs)}); its "
            f"first 64 KiB are those of {like or 'no object on the server'}"
        )
    return lines


def _first_difference(a: bytes, b: bytes) -> int | None:
    """Where two byte strings first differ (the shorter one's end if one is a prefix)."""
    block = 1 << 20
    for start in range(0, min(len(a), len(b)), block):
        x, y = a[start : start + block], b[start : start + block]
        if x != y:
            return start + next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    main()
