"""bench/checkpoint/saves.py --s3: unbroken's commit and restore on a real S3 server, against
raw clients moving the same bytes.

One process, one model (an MLP and Adam, as bench/checkpoint/saves.py builds it, without the
ranks): unbroken saves it to ``s3://`` (commit: from the save call until the checkpoint
is durably committed) and restores it with an empty staging tier (every byte from S3,
checked bitwise against the state saved). The raw columns move the very objects that
save wrote: obstore's multipart put and parallel ranged gets, boto3's upload_fileobj /
download_fileobj with a tuned TransferConfig. Every row is timed ``reps`` times, the
columns interleaved so the machine's drift hits each alike; the best of each is shown.
Beside each row: what limited it, from the CPU the server, this process and the delay
line used over its wall time (a 2-core machine is full at 2 cores).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.checkpoint.job import checksum, model_shape
from bench.checkpoint.rows import local_tensors

MB = 1e6
RAW_PART = 16 << 20
"""Raw clients' part size: multipart put chunks, ranged-get ranges, boto3's chunksize."""
RAW_STREAMS = 8
"""Raw clients' parallel parts (obstore max_concurrency, get threads, boto3 threads)."""
COLUMNS = ("unbroken", "obstore", "boto3")
TARGET = 0.9
"""The issue's bound: commit >= 0.9x raw put, restore >= 0.9x raw get."""


@dataclass
class S3Config:
    """One ``--s3`` run."""

    params_gb: float = 1 / 3
    """GiB of fp32 parameters (Adam adds twice as much: ~1 GiB of state by default)."""
    profiles: tuple[str, ...] = ("loopback", "far")
    """Remote profiles (bench/common/s3remote.py), all on one server."""
    reps: int = 3
    """Timed repetitions of every cell (best shown)."""
    quick: bool = False
    work_dir: str = ""
    """Scratch: the staging tiers."""


@dataclass
class Measured:
    """One timed transfer: wall seconds and the CPU each party spent meanwhile."""

    nbytes: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    proxy_cpu_s: float = 0.0
    machine_cpu_s: float | None = None
    """Every core's busy time (other agents' jobs included), where known."""

    @property
    def mbps(self) -> float:
        return self.nbytes / self.seconds / MB if self.seconds > 0 else math.nan

    def cores(self, cpu_s: float | None) -> float | None:
        return None if cpu_s is None or self.seconds <= 0 else cpu_s / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "mbps": self.mbps,
            "seconds": self.seconds,
            "client_cores": self.cores(self.client_cpu_s),
            "server_cores": self.cores(self.server_cpu_s),
            "proxy_cores": self.cores(self.proxy_cpu_s),
            "machine_cores": self.cores(self.machine_cpu_s),
        }


def machine_busy_seconds() -> float:
    """Busy time of every core so far (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6) if i < len(fields)) / os.sysconf("SC_CLK_TCK")


def measure(
    remote: Any,
    nbytes: int,
    fn: Callable[[], object],
    seconds_of: Callable[[], float | None] | None = None,
) -> Measured:
    """Run ``fn`` once, timed, with the CPU of this process, the server and the proxy.

    ``seconds_of``: the transfer's own seconds, where ``fn`` does more than the transfer
    (unbroken's save and wait: the wait includes retention, after the commit)."""
    s0, p0, m0 = remote.server_cpu_seconds(), remote.proxy_cpu_seconds(), machine_busy_seconds()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    own = seconds_of() if seconds_of is not None else None
    seconds = own if own else seconds
    return Measured(
        nbytes,
        seconds,
        time.process_time() - c0,
        remote.server_cpu_seconds() - s0,
        remote.proxy_cpu_seconds() - p0,
        machine_busy_seconds() - m0,
    )


def limit(m: Measured, cores: int, latency_ms: float) -> str:
    """What held a transfer back, from who was busy while it ran (pure)."""
    server, client = m.cores(m.server_cpu_s) or 0.0, m.cores(m.client_cpu_s) or 0.0
    proxy = m.cores(m.proxy_cpu_s) or 0.0
    ours = server + client + proxy
    busy = max(ours, m.cores(m.machine_cpu_s) or 0.0)
    figures = f"server {server:.2f}, client {client:.2f}"
    if proxy:
        figures += f", proxy {proxy:.2f}"
    others = busy - ours
    if others > 0.1:
        figures += f", rest {others:.2f}"
    if busy >= 0.85 * cores:
        shares = {"server": server, "client": client, "proxy": proxy, "rest": others}
        why = f"machine CPU ({cores} cores full, most to the {max(shares, key=shares.get)})"
    elif server >= 0.85:
        why = "server CPU"
    elif client >= 0.85:
        why = "client CPU"
    elif latency_ms:
        why = f"latency ({latency_ms:g} ms/request)"
    else:
        why = "link / server I/O"
    return f"{why}: {figures} cores"


# -- the state -----------------------------------------------------------------------


def build_state(params_gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of ``params_gb`` GiB and its Adam state (one step taken: moments exist)."""
    torch.manual_seed(0)
    width, layers = model_shape(params_gb * (1 << 30), 2)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


# -- one profile -----------------------------------------------------------------------


@dataclass
class ProfileResult:
    name: str
    latency_ms: float
    nbytes: int = 0
    commit: dict[str, list[Measured]] = field(default_factory=dict)
    restore: dict[str, list[Measured]] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """unbroken's own split of its last commit (staging, local, upload, commit)."""
    proxy_cpu_s: float = 0.0


def _obstore(remote: Any, root: str) -> Any:
    import unbroken as ub

    return ub.open_store(f"s3://{root}", **remote.storage_options)._store


def run_profile(remote: Any, name: str, cfg: S3Config, state: dict[str, Any]) -> ProfileResult:
    """Every cell of one profile: unbroken's save and restore, the raw clients' put/get."""
    import obstore
    from boto3.s3.transfer import TransferConfig

    import unbroken as ub
    from unbroken.checkpoint.format.manifest import step_dir

    out = ProfileResult(name, remote.latency_ms)
    proxy0 = remote.proxy_cpu_seconds()
    root = remote.new_root()
    bucket, prefix = root.split("/", 1)
    url = f"s3://{root}/ckpt"
    staging = tempfile.mkdtemp(prefix=f"s3-{name}-", dir=cfg.work_dir)
    mgr = ub.CheckpointManager(
        url, staging_dir=staging, every_steps=None, keep_last=2, async_save=True,
        storage_options=remote.storage_options, goodput=False, mlflow=False,
        preemption="off", when_busy="wait",
    )  # fmt: skip
    tensors = local_tensors(state["model"], state["optim"])
    step = 0
    mgr.save(step, state)  # warm-up: staging buffers, connections; and the objects below
    mgr.wait()
    store = ub.open_store(url, **remote.storage_options)
    objects = [e for e in store.list(step_dir(step)) if not e.key.endswith("writer.json")]
    blobs = {e.key: store.read_bytes(e.key) for e in objects}
    out.nbytes = sum(len(b) for b in blobs.values())
    raw = _obstore(remote, f"{root}/raw")
    client = remote.client(max_pool_connections=2 * RAW_STREAMS)
    transfer = TransferConfig(
        multipart_threshold=RAW_PART, multipart_chunksize=RAW_PART, max_concurrency=RAW_STREAMS
    )

    def put_obstore() -> None:
        for key, data in blobs.items():
            obstore.put(raw, key, memoryview(data), chunk_size=RAW_PART,
                        max_concurrency=RAW_STREAMS)  # fmt: skip

    def put_boto3() -> None:
        for key, data in blobs.items():  # BytesIO of bytes shares them: no copy
            client.upload_fileobj(io.BytesIO(data), bucket, f"{prefix}/boto/{key}", Config=transfer)

    def get_obstore(store: Any) -> None:
        for key, data in blobs.items():
            size = len(data)

            def one(start: int, key: str = key, size: int = size) -> Any:
                return obstore.get_range(store, key, start=start, end=min(size, start + RAW_PART))

            with ThreadPoolExecutor(RAW_STREAMS) as pool:
                list(pool.map(one, range(0, size, RAW_PART)))

    def get_boto3(client: Any) -> None:
        for key in blobs:
            client.download_fileobj(bucket, f"{prefix}/boto/{key}", io.BytesIO(), Config=transfer)

    reference = checksum(tensors)
    for _ in range(cfg.reps):
        step += 1
        save_step = step

        def save(save_step: int = save_step) -> None:
            mgr.save(save_step, state)
            mgr.wait()

        def committed() -> float | None:  # save() to commit: the retention after it aside
            return mgr.stats.last_commit_seconds

        for column, fn in (("unbroken", save), ("obstore", put_obstore), ("boto3", put_boto3)):
            seconds_of = committed if column == "unbroken" else None
            out.commit.setdefault(column, []).append(measure(remote, out.nbytes, fn, seconds_of))
        if mgr.stats.failed:
            raise RuntimeError(f"{name}: unbroken's save of step {save_step} failed")
        out.phases = dict(mgr.stats.last_phase_seconds)
        fresh = tempfile.mkdtemp(prefix=f"s3-{name}-restore-", dir=cfg.work_dir)
        reader = ub.CheckpointManager(
            url, staging_dir=fresh, every_steps=None, storage_options=remote.storage_options,
            goodput=False, mlflow=False, preemption="off",
        )  # fmt: skip
        for t in tensors:
            t.zero_()
        got: list[int | None] = []

        def restore(reader: Any = reader, got: list[int | None] = got) -> None:
            got.append(reader.restore(state))

        out.restore.setdefault("unbroken", []).append(measure(remote, out.nbytes, restore))
        reader.close()
        shutil.rmtree(fresh, ignore_errors=True)
        if got != [save_step] or checksum(tensors) != reference:
            raise RuntimeError(f"{name}: restore gave step {got} or other bytes than saved")
        # A restore is a restarted job's: its connections are new, so are the raw clients'.
        fresh_store = _obstore(remote, f"{root}/raw")
        fresh_client = remote.client(max_pool_connections=2 * RAW_STREAMS)
        for column, get, client in (
            ("obstore", get_obstore, fresh_store),
            ("boto3", get_boto3, fresh_client),
        ):
            cell = measure(remote, out.nbytes, functools.partial(get, client))
            out.restore.setdefault(column, []).append(cell)
    mgr.close()
    shutil.rmtree(staging, ignore_errors=True)
    out.proxy_cpu_s = remote.proxy_cpu_seconds() - proxy0
    return out


# -- the report (pure) -------------------------------------------------------------------


def best(cells: Sequence[Measured]) -> Measured | None:
    """The fastest of a cell's repetitions."""
    return max(cells, key=lambda m: m.mbps) if cells else None


def raw_best(cells: dict[str, list[Measured]]) -> tuple[str, Measured] | None:
    """The fastest raw client of a row (the bound unbroken is held to)."""
    found = [(c, best(cells.get(c, []))) for c in COLUMNS[1:]]
    found = [(c, m) for c, m in found if m is not None]
    return max(found, key=lambda cm: cm[1].mbps) if found else None


def ratio(cells: dict[str, list[Measured]]) -> float | None:
    ours, raw = best(cells.get("unbroken", [])), raw_best(cells)
    if ours is None or raw is None or not raw[1].mbps:
        return None
    return ours.mbps / raw[1].mbps


def rows(results: Sequence[ProfileResult], cores: int) -> list[dict[str, Any]]:
    """One row per profile and operation, with the figures the table and JSON show."""
    out = []
    for r in results:
        for op, cells in (("commit", r.commit), ("restore", r.restore)):
            raw = raw_best(cells)
            ours = best(cells.get("unbroken", []))
            row: dict[str, Any] = {"profile": r.name, "op": op, "ratio": ratio(cells)}
            for column in COLUMNS:
                m = best(cells.get(column, []))
                row[column] = None if m is None else m.mbps
            row["raw"] = None if raw is None else raw[0]
            row["limit_unbroken"] = None if ours is None else limit(ours, cores, r.latency_ms)
            row["limit_raw"] = None if raw is None else limit(raw[1], cores, r.latency_ms)
            out.append(row)
    return out


def _mbps(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.0f}"


def format_table(table: Sequence[dict[str, Any]]) -> str:
    """The side-by-side MB/s, the ratio to the best raw client, and what limited each."""
    header = ["profile", "op", "unbroken MB/s", "obstore MB/s", "boto3 MB/s", "x raw"]
    body = [
        [
            r["profile"], r["op"], *(_mbps(r[c]) for c in COLUMNS),
            "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x",
        ]
        for r in table
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        return "  ".join(cells + [c.rjust(w) for c, w in zip(line[2:], widths[2:])])

    lines = [fmt(header), "  ".join("-" * w for w in widths), *(fmt(b) for b in body)]
    lines += [
        "",
        "what limits each row (cores busy over the row's wall time; rest: other jobs, and "
        "kernel work charged to no process, such as loopback TCP in softirq):",
    ]
    for r in table:
        lines.append(f"  {r['profile']} {r['op']}: unbroken: {r['limit_unbroken']}")
        lines.append(f"  {r['profile']} {r['op']}: raw ({r['raw']}): {r['limit_raw']}")
    return "\n".join(lines)


def targets(table: Sequence[dict[str, Any]]) -> list[tuple[str, float | None, bool | None]]:
    """(name, measured ratio, met) per row: commit >= 0.9x raw put, restore >= 0.9x get."""
    out = []
    for r in table:
        what = "raw put" if r["op"] == "commit" else "raw get"
        name = f"{r['profile']} {r['op']} >= {TARGET}x {what} ({r['raw']})"
        out.append((name, r["ratio"], None if r["ratio"] is None else r["ratio"] >= TARGET))
    return out


def format_targets(table: Sequence[dict[str, Any]]) -> str:
    lines = ["targets (reported, not asserted):"]
    for name, measured, met in targets(table):
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[met]
        shown = "n/a" if measured is None else f"{measured:.2f}x"
        lines.append(f"  {name}: measured {shown}: {verdict}")
    return "\n".join(lines)


def json_line(table: Sequence[dict[str, Any]], extra: dict[str, Any]) -> str:
    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return None if math.isnan(v) else round(v, 4)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    met = [m for _, _, m in targets(table)]
    body = {
        "rows": list(table),
        "targets_met": sum(1 for m in met if m),
        "targets_total": len(met),
        **extra,
    }
    return json.dumps(clean(body), sort_keys=True)


def report(results: Sequence[ProfileResult], cfg: S3Config, head: str, extra: dict) -> str:
    cores = os.cpu_count() or 1
    table = rows(results, cores)
    nbytes = results[0].nbytes if results else 0
    lines = [
        head,
        f"checkpoint over S3: one process, state {nbytes / MB:.0f} MB (params "
        f"{cfg.params_gb:.3g} GiB + Adam), best of {cfg.reps}; raw clients move the same "
        f"objects ({RAW_PART >> 20} MiB parts, {RAW_STREAMS} streams)",
        "commit: from save() until the checkpoint is committed in S3 (retention after it not "
        "counted); restore: a new manager (a restarted job: new connections, as the raw "
        "clients' for their gets), an empty staging tier, every byte from S3, checked bitwise",
        "",
        format_table(table),
    ]
    for r in results:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items() if k != "total")
        lines.append(f"  {r.name}: unbroken's last commit by phase (s): {phases}")
        if r.latency_ms:
            lines.append(
                f"  {r.name}: the delay line's own CPU over the profile: {r.proxy_cpu_s:.2f} s"
            )
    phases = {r.name: r.phases for r in results}
    proxy = {r.name: r.proxy_cpu_s for r in results}
    lines += [
        "",
        format_targets(table),
        json_line(table, {**extra, "phases": phases, "proxy_cpu_s": proxy,
                          "state_mb": nbytes / MB}),
    ]  # fmt: skip
    return "\n".join(lines)


def main_s3(cfg: S3Config) -> str:
    """Start the server (and the delay line per far profile), run every profile, report."""
    from bench.common.s3remote import PROFILES, S3Remote

    started, load = time.time(), os.getloadavg()
    model, optim = build_state(cfg.params_gb)
    state = {"model": model, "optim": optim}
    results = []
    with S3Remote() as loopback:
        for name in cfg.profiles:
            remote = loopback if name == "loopback" else S3Remote(PROFILES[name], loopback.server)
            try:
                results.append(run_profile(remote, name, cfg, state))
            finally:
                if remote is not loopback:
                    remote.close()
        head = f"server: {loopback.describe()}; far: +{PROFILES['far']:g} ms/request"
    load_end = os.getloadavg()
    head += (
        f"\nload average {load[0]:.2f} at start, {load_end[0]:.2f} at end ({os.cpu_count()} cores)"
    )
    extra = {
        "quick": cfg.quick,
        "reps": cfg.reps,
        "load_start": round(load[0], 2),
        "load_end": round(load_end[0], 2),
        "seconds": round(time.time() - started, 1),
    }
    return report(results, cfg, head, extra)
