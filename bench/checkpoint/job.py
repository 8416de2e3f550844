"""The rank side of bench/checkpoint/saves.py: the model, the training loop, one row on one rank.

Every figure of a row is measured here, on each rank, and combined across ranks with an
``all_reduce(MAX)``; rank 0 writes the row's result as JSON for the parent to read.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from bench.checkpoint.measure import (
    MemorySampler,
    cold_read_bandwidth,
    cpu_clocks,
    evict_from_page_cache,
    excess_over_median,
    ranks_on_node,
)
from bench.checkpoint.rows import BASELINES, ROWS, RowContext, local_tensors

ROW_CLASSES = {cls.key: cls for cls in ROWS}
WARM_UP_SAVES = 2
"""Saves before the timed loop, at steps 0 and 1 (the loop saves every K >= 2 steps)."""
SETTLE_STEPS = 2
"""Untimed training steps right before the timed loop, in every row. The warm-up saves
leave the model idle for half a minute, and this VM hands memory idle that long back to
the host: without them the first timed step of a saving row paid 1.5-3.5 s to fault the
parameters and Adam state back in, which the no-saves rows never pay."""
ROW_TITLES = {cls.key: cls.title for cls in ROWS}


@dataclasses.dataclass
class Config:
    """One benchmark run; the same object travels to every rank."""

    params_gb: float = 1.0
    """GiB of fp32 parameters in the whole model (Adam adds twice as much state)."""
    ranks: int = 2
    """Number of gloo ranks; FSDP2 shards the state across them."""
    saves: int = 20
    """Saves per row in the timed run (plus two warm-up saves and one commit probe)."""
    every: int | None = None
    """Steps between saves; None: long enough for one save to cross the link."""
    batch: int = 8
    """Rows per training batch on each rank."""
    rows: tuple[str, ...] = tuple(ROW_CLASSES)
    """Which rows to run, in order; the baseline is always first (and by default also last)."""
    isolate: bool = True
    """Run every row in fresh rank processes (clean memory figures; slower)."""
    latency: float = 0.020
    """Emulated remote: seconds per request."""
    bandwidth: float = 200e6
    """Emulated remote: bytes/second of the node-wide link."""
    link: str = "ckpt-bench"
    """Name of this run's emulated link (its own, so other users of the node don't share it)."""
    work_dir: str = ""
    """Scratch directory: staging tiers, spill files, results (and the remote by default)."""
    remote_dir: str = ""
    """Local directory behind the emulated remote ("": <work_dir>/remote). Elsewhere than
    the staging tier's disk, the remote's own writes do not compete with the local tier."""
    pg_timeout_s: float = 1800.0
    """Collective timeout: a hung rank fails its row instead of the whole run."""
    row_timeout_s: float = 3600.0
    """Wall-clock limit for one row (or one group of rows) before its ranks are killed."""
    quick: bool = False
    """The --quick smoke run: tiny state, few steps."""
    keep: bool = False
    """Keep the scratch directory afterwards (to look at what each row wrote)."""
    all_columns: bool = False
    """Print every column of the table and its legend, not only the compared ones."""

    @property
    def remote_options(self) -> dict[str, Any]:
        return {"latency": self.latency, "bandwidth": self.bandwidth, "link": self.link}


# -- the model and its training step ----------------------------------------------------


def model_shape(params_bytes: float, min_layers: int = 8) -> tuple[int, int]:
    """(width, layers) of a square MLP with about ``params_bytes`` of fp32 weights.

    Between ``min_layers`` and twice that many layers of a power-of-two width: 1 GiB is
    16 layers of 4096 x 4096.
    """
    params = max(params_bytes / 4, 64 * 64 * 2)
    width = int(2 ** math.floor(math.log2(math.sqrt(params / min_layers))))
    width = min(8192, max(64, width))
    return width, max(2, round(params / (width * width)))


def build(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width, layers = model_shape(cfg.params_gb * (1 << 30), 2 if cfg.quick else 8)
    blocks = []
    for _ in range(layers):
        linear = torch.nn.Linear(width, width, bias=False)
        torch.nn.init.normal_(linear.weight, std=width**-0.5)
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    model = torch.nn.Sequential(*blocks)
    for block in model:
        # Keep the gathered weights from forward to backward (one all-gather per block
        # per step, not two): 2 CPU cores spend most of a step in gloo copies otherwise.
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optim, width


def train_step(model: torch.nn.Module, width: int, batch: int, gen: torch.Generator) -> None:
    """Forward and backward; FSDP2 all-gathers and reduce-scatters across ranks."""
    x = torch.randn(batch, width, generator=gen)
    model(x).square().mean().backward()


def train_untimed(model: torch.nn.Module, optim: Any, width: int, batch: int, gen: Any, n: int):
    """``n`` whole steps (forward, backward, optimizer) outside any measurement."""
    for _ in range(n):
        train_step(model, width, batch, gen)
        optim.step()
        optim.zero_grad(set_to_none=True)


def checksum(tensors: list[torch.Tensor]) -> list[int]:
    """crc32c of every tensor's bytes: a restore must bring back each byte in its place."""
    return [crc32c.crc32c(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in tensors]


# -- one row on one rank ----------------------------------------------------------------


def _max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed_max(fn: Any) -> tuple[float, Any]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return _max([time.perf_counter() - t0])[0], out


def calibrate_every(cfg: Config, model: Any, optim: Any, width: int, state_bytes: int) -> int:
    """Steps between saves so that one save has time to cross the link."""
    gen = torch.Generator().manual_seed(1)
    dist.barrier()
    t0 = time.perf_counter()
    train_untimed(model, optim, width, cfg.batch, gen, 3)
    step_s = _max([(time.perf_counter() - t0) / 3])[0]
    upload_s = state_bytes / cfg.bandwidth + cfg.latency
    return int(min(200, max(2, math.ceil(1.25 * upload_s / step_s))))


def run_row(key: str, rank: int, cfg: Config) -> dict[str, Any]:
    gc.collect()
    model, optim, width = build(cfg)
    gen = torch.Generator().manual_seed(100 + rank)
    train_untimed(model, optim, width, cfg.batch, gen, 2)  # creates Adam's state
    rank_bytes = sum(t.nbytes for t in local_tensors(model, optim))
    sizes = torch.tensor([rank_bytes, rank_bytes], dtype=torch.float64)
    dist.all_reduce(sizes[:1], op=dist.ReduceOp.SUM)
    dist.all_reduce(sizes[1:], op=dist.ReduceOp.MAX)
    state_bytes, max_rank_bytes = int(sizes[0]), int(sizes[1])
    every = cfg.every or calibrate_every(cfg, model, optim, width, state_bytes)

    row_dir = os.path.join(cfg.remote_dir, key)
    os.makedirs(row_dir, exist_ok=True)
    ctx = RowContext(
        model, optim, rank, every, row_dir, os.path.join(cfg.work_dir, key), cfg.remote_options
    )
    gc.collect()
    sampler = MemorySampler(tier_share=ranks_on_node()).start()
    rss0 = sampler.sample()
    try:
        row = ROW_CLASSES[key](ctx)
    except (ImportError, AttributeError) as e:  # the library part is not there yet
        sampler.stop()
        return {"error": f"{type(e).__name__}: {e}"}
    if key not in BASELINES:
        # Warm-up, not timed: buffers, helper processes, first-use costs (two saves, so
        # that the timed saves see whatever steady state a row reaches after the first).
        for warm_up_step in range(WARM_UP_SAVES):
            row.save(warm_up_step)
            row.drain()

    train_untimed(model, optim, width, cfg.batch, gen, SETTLE_STEPS)

    steps = (cfg.saves + 1) * every - 1
    blocked, optim_s, after_save, step_ends = 0.0, [], [], []
    flag = False
    dist.barrier()
    cpu0 = cpu_clocks()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(model, width, cfg.batch, gen)
        tb = time.perf_counter()
        row.before_optim_step()
        to = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        row.on_step(step)
        blocked += (to - tb) + (time.perf_counter() - t1)
        optim_s.append(t1 - to)
        after_save.append(flag)
        flag = row.is_save_step(step)
        step_ends.append(time.perf_counter() - t0)
    dist.barrier()
    loop_s = time.perf_counter() - t0
    cpu = cpu_clocks().minus(cpu0)
    row.drain()
    rss_end = sampler.sample()
    peak = sampler.stop()
    blocked += excess_over_median(optim_s, after_save)

    result: dict[str, Any] = {
        "every": every,
        "steps": steps,
        "state_bytes": state_bytes,
        "rank_bytes": max_rank_bytes,
        # Where in the loop the extra time went (near saves, or all along): rank 0's clock.
        "step_ends_s": [round(t, 4) for t in step_ends],
    }
    commit_s = restore_local_s = restore_durable_s = local_tier_bps = -1.0
    if key not in BASELINES:
        commit_s, _ = _timed_max(lambda: (row.save(steps + 1), row.drain()))
        reference = checksum(local_tensors(model, optim))
        row.prepare_restore()
        if key == "unbroken":
            local_tier_bps = _local_tier_bandwidth(row, rank)  # leaves the files evicted
        restore_local_s = _restore_timed(row.restore_local, model, optim, reference)
        if rank == 0:  # the remote's files: from its disk, not from memory
            evict_from_page_cache(row_dir)
        restore_durable_s = _restore_timed(row.restore_durable, model, optim, reference)
        result.update(row.notes())
        row.close()
    stats = _max(
        [
            blocked / max(1, cfg.saves) if key not in BASELINES else -1.0,
            loop_s,
            commit_s,
            float(peak),
            float(rss_end - rss0),
            restore_local_s,
            restore_durable_s,
            local_tier_bps,
        ]
    )
    names = [
        "blocked_s",
        "loop_s",
        "commit_s",
        "peak_pss",
        "rss_growth",
        "restore_local_s",
        "restore_durable_s",
        "local_tier_bps",
    ]
    result.update({n: (None if v < 0 and n != "rss_growth" else v) for n, v in zip(names, stats)})
    # Machine-wide CPU is the same figure on every rank; the process figures add up.
    totals = torch.tensor([cpu.process_s, cpu.main_thread_s], dtype=torch.float64)
    dist.all_reduce(totals)
    result["machine_cpu_s"] = cpu.machine_s
    result["off_main_cpu_s"] = float(totals[0] - totals[1])
    if rank == 0 and not cfg.keep:  # one row's checkpoints at a time on the disk
        shutil.rmtree(row_dir, ignore_errors=True)
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    return result


def _restore_timed(restore: Any, model: Any, optim: Any, reference: list[int]) -> float:
    """Zero the live state, restore, check every tensor came back; -1 if no such tier."""
    for t in local_tensors(model, optim):
        t.zero_()
    seconds, done = _timed_max(restore)
    if done is None:
        return -1.0
    got = checksum(local_tensors(model, optim))
    bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    if bad:
        raise RuntimeError(
            f"restore via {restore.__qualname__} gave different values in "
            f"{len(bad)} of {len(got)} tensors (first: #{bad[0]})"
        )
    return seconds


def _local_tier_bandwidth(row: Any, rank: int) -> float:
    """Cold sequential read speed of the newest checkpoint's files in the staging tier."""
    bps = cold_read_bandwidth(row.local_tier_files()) if rank == 0 else None
    return -1.0 if bps is None else bps


def join_ranks(rank: int, cfg: Config, port: int) -> None:
    """One rank's setup: its share of the cores, the gloo group on ``port``."""
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: where is a hung rank?
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ranks))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=cfg.ranks,
        timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
    )


def rank_main(rank: int, cfg: Config, keys: list[str], port: int) -> None:
    t0 = time.monotonic()
    join_ranks(rank, cfg, port)
    if rank == 0:
        print(f"[checkpoint bench] ranks up ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    try:
        for key in keys:
            t0 = time.monotonic()
            result = run_row(key, rank, cfg)
            if rank == 0:
                print(
                    f"[checkpoint bench] {ROW_TITLES[key]}: {time.monotonic() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            if key == "baseline" and cfg.every is None and "every" in result:
                cfg.every = result["every"]
            if rank == 0:
                path = os.path.join(cfg.work_dir, "results", f"{key}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(result, f)
                os.replace(path + ".tmp", path)
            dist.barrier()
    finally:
        dist.destroy_process_group()
