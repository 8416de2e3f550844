"""GPU checkpoint benchmark: CUDA state, pinned staging, NCCL + gloo groups, restore to CUDA.

One prepared run of a few minutes on one machine, one rank per GPU: an FSDP2 model and
Adam on CUDA, the default process group ``cuda:nccl,cpu:gloo`` (NCCL for the training
collectives, gloo for CPU tensors; unbroken adds its own gloo group for coordination),
and each way of saving against a loop without saves:

- torch.save on rank 0 of the gathered full state (offloaded to the CPU);
- dcp.save; dcp.async_save with pinned-memory, non-blocking, async staging (the options
  torchtitan uses on GPUs) and the persistent checkpoint process;
- unbroken.CheckpointManager (its stager pins the host buffers of CUDA sources and
  copies on a side stream, fenced against the training stream).

Each row restores into the live CUDA state and checks it equal to what was saved. Every
row writes to the same local directory (``--dir``, the machine's disk) as its durable
tier: this run is about the device-to-host path, not the network. Prints a table and a
JSON line.

    PYTHONPATH=src python -m bench.checkpoint.gpu            # ranks = GPUs
    PYTHONPATH=src python -m bench.checkpoint.gpu --params-gb 4 --ranks 2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

NO_CUDA_EXIT = 3
"""Exit status where there is no CUDA device: nothing was measured."""


@dataclasses.dataclass
class GpuConfig:
    """One run; the same object goes to every rank."""

    params_gb: float = 1.0
    """GiB of fp32 parameters in the whole model (Adam adds twice as much state)."""
    ranks: int = 1
    """Ranks, one per GPU."""
    saves: int = 4
    """Timed saves per row (after one warm-up save)."""
    interval_s: float = 4.0
    """Training time between saves; the step count comes from the no-saves row's steps."""
    batch: int = 1024
    rows: tuple[str, ...] = ("baseline", "torch_save", "dcp_save", "dcp_async", "unbroken")
    dir: str = ""
    """Where every row's checkpoints go (its durable tier), and unbroken's staging tier."""
    device: str = "cuda"
    """"cuda"; "cpu" only to try the script's logic on a machine without a GPU."""
    timeout_s: float = 600.0


TITLES = {
    "baseline": "no saves",
    "torch_save": "torch.save rank 0",
    "dcp_save": "dcp.save",
    "dcp_async": "dcp.async_save (pinned, async staging)",
    "dcp_async_pinned": "dcp.async_save (pinned, no shm)",
    "dcp_async_default": "dcp.async_save default",
    "unbroken": "unbroken",
}
COLUMNS = [  # (key, title, divisor, digits)
    ("blocked_s", "loop blocked s/save", 1.0, 3),
    ("extra_s", "extra wall s/save", 1.0, 3),
    ("commit_s", "to commit s", 1.0, 2),
    ("restore_s", "restore to CUDA s", 1.0, 2),
    ("peak_host_gib", "peak host memory/rank GiB", 1.0, 2),
    ("peak_gpu_gib", "peak GPU GiB", 1.0, 2),
    ("in_save_s", "in save() s/save", 1.0, 3),
    ("busy_s", "of it: waiting for the last s/save", 1.0, 3),
    ("copy_s", "bg copy s/save", 1.0, 3),
    ("check_s", "of it: check s/save", 1.0, 3),
]


# -- rows: bench/checkpoint/saves.py's, with the durable tier in a local directory -------------


def _row_classes(pinned: bool) -> dict[str, type]:
    """The rows, by key; ``pinned``: dcp.async_save stages into pinned memory (CUDA)."""
    from bench.checkpoint.rows import (
        DcpAsyncBest,
        DcpAsyncDefault,
        DcpSave,
        RowContext,
        TorchSaveRank0,
        Unbroken,
    )

    @dataclasses.dataclass
    class LocalDirContext(RowContext):
        @property
        def store_url(self) -> str:
            return self.row_dir

    class OnLocalDir:
        def __init__(self, ctx: RowContext) -> None:
            fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(RowContext)}
            super().__init__(LocalDirContext(**fields))  # type: ignore[call-arg]

    class GpuTorchSave(OnLocalDir, TorchSaveRank0):
        pass

    class GpuDcpSave(OnLocalDir, DcpSave):
        pass

    class GpuDcpAsync(OnLocalDir, DcpAsyncBest):
        """What torchtitan turns on with a GPU: pinned host buffers, non-blocking copies."""

        OPTIONS = {
            "use_pinned_memory": pinned,
            "use_shared_memory": True,
            "use_async_staging": True,
            "use_non_blocking_copy": pinned,
        }

    class GpuDcpAsyncPinned(GpuDcpAsync):
        """The same without shared memory: pinned private buffers only."""

        OPTIONS = {**GpuDcpAsync.OPTIONS, "use_shared_memory": False}

    class GpuDcpAsyncDefault(OnLocalDir, DcpAsyncDefault):
        pass

    class GpuUnbroken(OnLocalDir, Unbroken):
        pass

    return {
        "torch_save": GpuTorchSave,
        "dcp_save": GpuDcpSave,
        "dcp_async": GpuDcpAsync,
        "dcp_async_pinned": GpuDcpAsyncPinned,
        "dcp_async_default": GpuDcpAsyncDefault,
        "unbroken": GpuUnbroken,
    }


# -- one rank -------------------------------------------------------------------------------


def _max(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)  # a CPU tensor: the gloo backend
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _build(cfg: GpuConfig, device: Any) -> tuple[Any, Any, int]:
    import torch
    from torch.distributed.fsdp import fully_shard

    from bench.checkpoint.job import model_shape

    torch.manual_seed(0)
    width, layers = model_shape(cfg.params_gb * (1 << 30))
    blocks = []
    for _ in range(layers):
        linear = torch.nn.Linear(width, width, bias=False, device=device)
        torch.nn.init.normal_(linear.weight, std=width**-0.5)
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    model = torch.nn.Sequential(*blocks)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), width


def _step(model: Any, optim: Any, width: int, cfg: GpuConfig, device: Any, row: Any = None):
    """One training step; the loss read back, as a logging loop does. Returns the seconds
    spent in the row's hooks (time the loop was blocked by saving)."""
    import torch

    x = torch.randn(cfg.batch, width, device=device)
    loss = model(x).square().mean()
    loss.backward()
    blocked = 0.0
    if row is not None:
        t0 = time.perf_counter()
        row.before_optim_step()
        blocked += time.perf_counter() - t0
    optim.step()
    optim.zero_grad(set_to_none=True)
    loss.item()
    return blocked


def run_row(key: str, rank: int, cfg: GpuConfig, every: int | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench.checkpoint.measure import GiB, MemorySampler, ranks_on_node
    from bench.checkpoint.rows import RowContext, local_tensors

    device = torch.device(cfg.device, rank) if cfg.device == "cuda" else torch.device("cpu")
    model, optim, width = _build(cfg, device)
    for _ in range(3):  # Adam's state, CUDA kernels and allocator warm
        _step(model, optim, width, cfg, device)
    state_bytes = float(sum(t.nbytes for t in local_tensors(model, optim)))
    t = torch.tensor([state_bytes], dtype=torch.float64)
    dist.all_reduce(t)
    if every is None:  # the no-saves row measures the step and fixes every
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            _step(model, optim, width, cfg, device)
        step_s = _max([(time.perf_counter() - t0) / 10])[0]
        every = int(min(100_000, max(2, math.ceil(cfg.interval_s / step_s))))
    row_dir = os.path.join(cfg.dir, key)
    os.makedirs(row_dir, exist_ok=True)
    ctx = RowContext(model, optim, rank, every, row_dir, os.path.join(cfg.dir, f"{key}-work"), {})
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampler = MemorySampler(tier_share=ranks_on_node()).start()
    row = _row_classes(cfg.device == "cuda")[key](ctx) if key != "baseline" else None
    if row is not None:
        row.save(0)  # warm-up: buffers, helper processes, first-use costs
        row.drain()
    steps = (cfg.saves + 1) * every - 1
    blocked = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        blocked += _step(model, optim, width, cfg, device, row)
        if row is not None:
            tb = time.perf_counter()
            row.on_step(step)
            blocked += time.perf_counter() - tb
    dist.barrier()
    loop_s = time.perf_counter() - t0
    result: dict[str, Any] = {"every": every, "steps": steps, "state_bytes": t.item()}
    commit_s = restore_s = -1.0
    if row is not None:
        row.drain()
        dist.barrier()
        t1 = time.perf_counter()
        row.save(steps + 1)
        row.drain()
        commit_s = _max([time.perf_counter() - t1])[0]
        reference = [x.clone() for x in local_tensors(model, optim)]
        row.prepare_restore()
        for x in local_tensors(model, optim):
            x.zero_()
        dist.barrier()
        t1 = time.perf_counter()
        _restore(row)
        if cfg.device == "cuda":
            torch.cuda.synchronize(device)
        restore_s = _max([time.perf_counter() - t1])[0]
        got = local_tensors(model, optim)
        bad = sum(1 for a, b in zip(got, reference) if a.device != b.device or not a.equal(b))
        if bad:
            raise RuntimeError(f"{key}: {bad} of {len(got)} tensors differ after the restore")
        del reference
        stats = getattr(getattr(row, "mgr", None), "stats", None)
        if stats is not None:  # unbroken: the background copy and its check, per save
            started = max(1, stats.started)
            sums = [stats.seconds_blocked, stats.seconds_waited_busy,
                    stats.seconds_staging_copy, stats.seconds_staging_check]  # fmt: skip
            names = ["in_save_s", "busy_s", "copy_s", "check_s"]
            result.update(zip(names, _max([v / started for v in sums])))
        row.close()
    peak = sampler.stop()
    peak_gpu = torch.cuda.max_memory_allocated(device) if cfg.device == "cuda" else 0
    stats = _max([blocked / cfg.saves, loop_s, commit_s, restore_s, peak / GiB, peak_gpu / GiB])
    names = ["blocked_s", "loop_s", "commit_s", "restore_s", "peak_host_gib", "peak_gpu_gib"]
    result.update({n: (None if v < 0 else v) for n, v in zip(names, stats)})
    if row is None:
        result["blocked_s"] = None
    if rank == 0:
        shutil.rmtree(row_dir, ignore_errors=True)
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    del model, optim, row
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _restore(row: Any) -> None:
    """From the durable tier where the row has one (unbroken: a manager with an empty
    staging tier, so the bytes come from the durable copy), else from its local one."""
    if row.restore_durable() is None:
        row.restore_local()


def rank_main(rank: int, cfg: GpuConfig, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "cuda:nccl,cpu:gloo"
    else:
        backend = "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=cfg.ranks, timeout=datetime.timedelta(seconds=cfg.timeout_s)
    )
    results: dict[str, Any] = {}
    every = None
    try:
        for key in cfg.rows:
            t0 = time.monotonic()
            try:
                results[key] = run_row(key, rank, cfg, every)
                every = every or results[key]["every"]
            except Exception as e:  # a row that fails is reported, the others still run
                results[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                traceback.print_exc()
            if rank == 0:
                print(f"[gpu checkpoint] {TITLES[key]}: {time.monotonic() - t0:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
            dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


# -- the parent: the table and the JSON line -----------------------------------------------


def add_extra(results: dict[str, dict], saves: int) -> None:
    base = (results.get("baseline") or {}).get("loop_s")
    for key, r in results.items():
        if key != "baseline" and base is not None and r.get("loop_s") is not None:
            r["extra_s"] = (r["loop_s"] - base) / saves


def format_table(results: dict[str, dict], order: tuple[str, ...]) -> str:
    header = ["row", *(c[1] for c in COLUMNS)]
    body, notes = [], []
    for key in order:
        r = results.get(key) or {"error": "not run"}
        if r.get("error"):
            body.append([TITLES[key], *("n/a" for _ in COLUMNS)])
            notes.append(f"  {TITLES[key]}: n/a: {r['error']}")
            continue
        cells = []
        for k, _, div, digits in COLUMNS:
            v = r.get(k)
            cells.append("n/a" if v is None else f"{v / div:.{digits}f}")
        body.append([TITLES[key], *cells])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        rest = (c.rjust(w) for c, w in zip(line[1:], widths[1:]))
        return "  ".join([line[0].ljust(widths[0]), *rest])

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body), *notes])


def parse_args(argv: list[str] | None = None) -> GpuConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-gb", type=float, default=1.0, help="GiB of parameters (1)")
    p.add_argument("--ranks", type=int, default=None, help="ranks, one per GPU (all GPUs)")
    p.add_argument("--saves", type=int, default=4, help="timed saves per row (4)")
    p.add_argument("--interval", type=float, default=4.0, help="seconds of training per save")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--rows", default=",".join(GpuConfig.rows), help="comma-separated subset")
    p.add_argument("--dir", default=None, help="checkpoint directory (a fresh temp dir)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: try the script's logic without a GPU (gloo only, no pinning)",
    )
    a = p.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in TITLES]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(TITLES)}")
    for name in ("params_gb", "saves", "interval", "batch"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.ranks is not None and a.ranks < 1:
        p.error(f"--ranks must be >= 1, got {a.ranks}")
    rows = ["baseline", *(r for r in rows if r != "baseline")]
    return GpuConfig(
        params_gb=a.params_gb,
        ranks=a.ranks or 0,
        saves=a.saves,
        interval_s=a.interval,
        batch=a.batch,
        rows=tuple(rows),
        dir=a.dir or "",
        device=a.device,
    )


def cuda_missing() -> str | None:
    """Why this machine cannot run the benchmark, or None where it can."""
    try:
        import torch
    except ImportError:
        return "gpu_checkpoint: torch is not installed"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"gpu_checkpoint: no CUDA device here (torch {torch.__version__}, {build}); "
            "run it on a machine with NVIDIA GPUs and a CUDA build of torch "
            "(--device cpu tries the logic on the CPU)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.device == "cuda":
        why = cuda_missing()
        if why:
            print(why, file=sys.stderr)
            return NO_CUDA_EXIT
    import torch
    import torch.multiprocessing as mp

    from bench.checkpoint.saves import free_port

    gpus = torch.cuda.device_count() if cfg.device == "cuda" else 1
    cfg.ranks = cfg.ranks or gpus
    if cfg.device == "cuda" and cfg.ranks > gpus:
        print(f"gpu_checkpoint: --ranks {cfg.ranks} but {gpus} GPU(s) here", file=sys.stderr)
        return 2
    own_dir = not cfg.dir
    cfg.dir = cfg.dir or tempfile.mkdtemp(prefix="gpu-ckpt-")
    os.makedirs(cfg.dir, exist_ok=True)
    out = os.path.join(cfg.dir, "results.json")
    started, load = time.time(), [round(v, 2) for v in os.getloadavg()]
    try:
        mp.start_processes(rank_main, args=(cfg, free_port(), out), nprocs=cfg.ranks,
                           join=True, start_method="spawn")  # fmt: skip
        with open(out) as f:
            results = json.load(f)
    finally:
        if own_dir:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    add_extra(results, cfg.saves)
    base = results.get("baseline") or {}
    names = [torch.cuda.get_device_name(i) for i in range(gpus)] if cfg.device == "cuda" else []
    print(
        f"GPU checkpoint benchmark: {cfg.ranks} rank(s) on {', '.join(names) or 'CPU'}, "
        f"state {(base.get('state_bytes') or 0) / (1 << 30):.2f} GiB (params "
        f"{cfg.params_gb:g} GiB + Adam), {cfg.saves} saves every {base.get('every')} steps, "
        f"checkpoints in {cfg.dir} (local disk); torch {torch.__version__}"
    )
    print(format_table(results, cfg.rows))
    payload = {
        "bench": "gpu_checkpoint",
        "device": names or ["cpu"],
        "ranks": cfg.ranks,
        "params_gb": cfg.params_gb,
        "saves": cfg.saves,
        "load_avg": load,
        "seconds": round(time.time() - started, 1),
        "rows": results,
    }
    print(json.dumps(payload, sort_keys=True, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
