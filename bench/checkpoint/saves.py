"""Checkpoint benchmark: what each way of saving costs a 2-rank training job.

Rows, measured side by side in one run on real gloo ranks (FSDP2, Adam), every remote
byte through the same emulated remote (20 ms/request, 200 MB/s node-wide link):
no saves (the baseline), a memcpy floor, that floor plus both tiers' disk writes,
torch.save on rank 0, dcp.save,
dcp.async_save with its defaults, dcp.async_save with its best working options, and
unbroken.CheckpointManager. Prints one table, the targets, and a final JSON line of
ratios. See bench/README.md, section bench/checkpoint/saves.py.

    python -m bench.checkpoint.saves --quick   # tiny state, < 1 minute
    python -m bench.checkpoint.saves           # the full run: 1 GiB params, 1-2 hours on 2 cores
    python -m bench.checkpoint.saves --s3 --quick  # commit/restore MB/s on a real S3 server vs raw
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from bench.checkpoint.job import ROW_CLASSES, ROW_TITLES, Config, rank_main
from bench.checkpoint.measure import (
    evaluate,
    format_table,
    format_targets,
    in_row_extra,
    json_line,
    lasting_extra,
)
from bench.checkpoint.rows import BASELINES
from bench.checkpoint.s3 import S3Config, main_s3
from unbroken.storage.link import discard_link

# -- the parent: launch ranks, survive a failing row, report ----------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cfg: Config, keys: list[str]) -> str | None:
    """Run ``keys`` on fresh ranks; None if they all finished, else why they did not."""
    ctx = mp.start_processes(
        rank_main, args=(cfg, keys, free_port()), nprocs=cfg.ranks, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + cfg.row_timeout_s * (1 if cfg.isolate else len(keys))
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                return f"timed out after {cfg.row_timeout_s:g} s"
        return None
    except ProcessException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return lines[-1] if lines else type(e).__name__
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def run_all(cfg: Config, between_rows: Callable[[], None] | None = None) -> dict[str, dict]:
    """Every row of ``cfg``; ``between_rows()`` runs after each launch, while no rank runs."""
    results_dir = os.path.join(cfg.work_dir, "results")
    os.makedirs(results_dir, exist_ok=True)
    results: dict[str, dict] = {}
    pending = list(cfg.rows)
    from tqdm import tqdm

    bar = tqdm(total=len(pending), desc="rows", unit="row", file=sys.stderr)
    while pending:
        batch = list(pending[:1] if cfg.isolate else pending)
        bar.set_postfix_str(",".join(batch))
        why = _launch(cfg, batch)
        left = len(pending)
        for key in batch:
            path = os.path.join(results_dir, f"{key}.json")
            pending.remove(key)
            if not os.path.exists(path):  # the first row without a result is the one that failed
                results[key] = {"error": why or "rank processes wrote no result"}
                break  # later rows get a fresh launch
            with open(path) as f:
                results[key] = json.load(f)
        bar.update(left - len(pending))
        if between_rows is not None:
            between_rows()
        base = results.get("baseline", {})
        if cfg.every is None and base.get("every"):
            cfg.every = base["every"]
    bar.close()
    return results


def baseline_values(results: dict[str, dict], key: str) -> list[float]:
    """``key`` of each no-saves run that has it."""
    values = [(results.get(k) or {}).get(key) for k in BASELINES]
    return [v for v in values if v is not None]


def baseline_mean(results: dict[str, dict], key: str) -> float | None:
    values = baseline_values(results, key)
    return sum(values) / len(values) if values else None


def baseline_loop(results: dict[str, dict]) -> tuple[float | None, float | None]:
    """(loop seconds without saves, the spread between its two runs when there are two)."""
    loops = baseline_values(results, "loop_s")
    spread = max(loops) - min(loops) if len(loops) > 1 else None
    return baseline_mean(results, "loop_s"), spread


def report(cfg: Config, results: dict[str, dict], started: float) -> str:
    base_loop, spread = baseline_loop(results)
    base_cpu = baseline_mean(results, "machine_cpu_s")
    base_off = baseline_mean(results, "off_main_cpu_s")
    commits = [(results.get(k) or {}).get("commit_s") for k in cfg.rows]
    settle_for_baselines = (results.get("unbroken") or {}).get("commit_s") or max(
        (c for c in commits if c is not None), default=None
    )
    rows = []
    for key in cfg.rows:
        r = dict(results.get(key, {"error": "not run"}))
        r["name"] = ROW_TITLES[key]
        per_save = [
            ("extra_s", "loop_s", base_loop),
            ("extra_cpu_s", "machine_cpu_s", base_cpu),
            ("off_main_cpu_s", "off_main_cpu_s", base_off),
        ]
        for out, source, base in per_save:  # beyond the no-saves runs, per save
            if not r.get("error") and base is not None and r.get(source) is not None:
                r[out] = (r[source] - base) / cfg.saves
        if not r.get("error") and r.get("step_ends_s") and r.get("every"):
            # The no-saves runs, split as if they saved like unbroken: the figure's noise.
            settle = r.get("commit_s") if key not in BASELINES else settle_for_baselines
            r["in_row_extra_s"] = in_row_extra(r["step_ends_s"], r["every"], settle or 0.0)
            if base_loop is not None:  # every row runs the same number of steps
                base_step = base_loop / len(r["step_ends_s"])
                r["lasting_extra_s"] = lasting_extra(
                    r["step_ends_s"], r["every"], settle or 0.0, base_step
                )
        rows.append(r)
        results[key] = r
    any_row = next((r for r in rows if r.get("state_bytes")), {})
    state_bytes = any_row.get("state_bytes", 0)
    env = {
        "state_bytes": state_bytes,
        "rank_bytes": any_row.get("rank_bytes", 0),
        "bandwidth": cfg.bandwidth,
        "latency": cfg.latency,
        "local_tier_bps": (results.get("unbroken") or {}).get("local_tier_bps"),
    }
    targets, ratios = evaluate(results, env)
    link_floor = state_bytes / cfg.bandwidth + cfg.latency
    noise = "" if spread is None else f"; the two no-saves runs differ by {spread / cfg.saves:.3f}"
    head = [
        f"checkpoint benchmark: {cfg.ranks} ranks (gloo, FSDP2, Adam), "
        f"state {state_bytes / (1 << 30):.3f} GiB in all "
        f"(params {cfg.params_gb:g} GiB + Adam), {cfg.saves} saves every {cfg.every} steps",
        f"remote: emulated, {cfg.latency * 1000:g} ms/request, {cfg.bandwidth / 1e6:g} MB/s "
        f"node-wide link; one save's bytes need at least {link_floor:.3f} s on it",
        "time lost: how much longer the training loop ran, per save, than with no saves"
        + (f"{noise} s/save (noise: a figure within that of zero is zero)" if noise else ""),
        "loop blocked: time inside the save calls and waits; save to commit: one save at rest",
    ]
    if cfg.all_columns:
        opts = ", ".join(f"{k}={v}" for k, v in ROW_CLASSES["dcp_async_best"].OPTIONS.items())
        head += [
            f"remote bytes kept in {cfg.remote_dir}",
            f"dcp.async_save best = DefaultStager(StagingOptions({opts})), "
            f"AsyncCheckpointerType.PROCESS",
            "machine CPU: CPU the whole machine spent beyond the no-saves runs, per save; "
            "background CPU: the ranks' threads other than the training thread",
            "lost in run: a row's save steps and steps with a save in flight against the mean "
            "of its own quiet steps; on the no-saves runs, the same split (as if saving like "
            "unbroken) shows that figure's noise",
            "lost after commit: how much a row's quiet steps (after a save has committed) "
            "exceed the no-saves runs' mean step, over the steps from the first save on, per "
            "save; lost in run + lost after commit make up time lost",
        ]
    else:
        head.append("(--all-columns: CPU, peak memory and the split of the time lost)")
    head.append("")
    error = (results.get("unbroken") or {}).get("error")
    extra = {
        "quick": cfg.quick,
        "state_gib": round(state_bytes / (1 << 30), 4),
        "saves": cfg.saves,
        "every": cfg.every,
        "ranks": cfg.ranks,
        "seconds": round(time.time() - started, 1),
        "noise_s_per_save": None if spread is None else round(spread / cfg.saves, 4),
        "unbroken_error": error,
        "unbroken_lasting_s_per_save": (results.get("unbroken") or {}).get("lasting_extra_s"),
    }
    return "\n".join(
        [
            *head,
            format_table(rows, cfg.all_columns),
            "",
            format_targets(targets),
            json_line(ratios, extra),
        ]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--s3",
        action="store_true",
        help="commit and restore MB/s on a real S3 server (SeaweedFS) against raw clients "
        "moving the same bytes, instead of the training-job rows",
    )
    p.add_argument(
        "--profile",
        choices=("loopback", "far", "both"),
        default="both",
        help="with --s3: the server as it is, behind a +20 ms/request delay line, or both",
    )
    p.add_argument("--reps", type=int, default=None, help="with --s3: timed repetitions (3)")
    p.add_argument("--quick", action="store_true", help="tiny state, few steps: < 1 minute")
    p.add_argument("--params-gb", type=float, default=None, help="GiB of parameters (1)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=None, help="saves per row (20; quick 3)")
    p.add_argument("--every", type=int, default=None, help="steps between saves (auto)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--rows",
        default=",".join(ROW_CLASSES),
        help=f"comma-separated subset of {','.join(ROW_CLASSES)}",
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fresh rank processes per row (default: on, off with --quick)",
    )
    p.add_argument(
        "--baseline-twice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the no-saves baseline first and last, to show the noise "
        "(default: on, off with --quick)",
    )
    p.add_argument("--work-dir", default=None, help="scratch directory (a fresh temp dir)")
    p.add_argument(
        "--remote-dir",
        default=None,
        help="where the emulated remote keeps its bytes (default: inside --work-dir); "
        "e.g. /dev/shm, so the remote's writes do not share the staging tier's disk",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument(
        "--all-columns",
        action="store_true",
        help="print every column (CPU, peak memory, the split of the time lost)",
    )
    p.add_argument("--row-timeout", type=float, default=None, help="seconds per row")
    return p


def s3_config(a: argparse.Namespace) -> S3Config:
    """The ``--s3`` run: a few hundred MB of state with --quick, ~1 GiB without."""
    profiles = ("loopback", "far") if a.profile == "both" else (a.profile,)
    return S3Config(
        params_gb=a.params_gb or (0.1 if a.quick else 1 / 3),
        profiles=profiles,
        reps=a.reps or (2 if a.quick else 3),
        quick=a.quick,
        work_dir=a.work_dir or "",
    )


def check_loop_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The loop's sizes must be positive, and ``--every`` leave room for the warm-up."""
    for name in ("params_gb", "saves", "every", "row_timeout"):
        value = getattr(a, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if a.every is not None and a.every < 2:
        p.error(f"--every must be at least 2 (the warm-up saves steps 0 and 1), got {a.every}")


def parse_args(argv: list[str] | None = None) -> Config:
    p = _parser()
    a = p.parse_args(argv)
    keys = [k.strip() for k in a.rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROW_CLASSES]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(ROW_CLASSES)}")
    keys = ["baseline"] + [k for k in keys if k not in BASELINES]
    if a.baseline_twice or (a.baseline_twice is None and not a.quick):
        keys.append("baseline_end")
    check_loop_args(p, a)
    cfg = Config(
        params_gb=a.params_gb or (0.004 if a.quick else 1.0),
        ranks=a.ranks,
        saves=a.saves or (3 if a.quick else 20),
        every=a.every,
        batch=a.batch,
        rows=tuple(keys),
        isolate=(not a.quick) if a.isolate is None else a.isolate,
        link=f"ckpt-bench-{os.getpid()}",
        work_dir=a.work_dir or "",
        remote_dir=a.remote_dir or "",
        pg_timeout_s=120.0 if a.quick else 1800.0,
        row_timeout_s=a.row_timeout or (120.0 if a.quick else 3600.0),
        keep=a.keep,
        quick=a.quick,
        all_columns=a.all_columns,
    )
    if cfg.ranks < 1:
        p.error(f"--ranks must be >= 1, got {cfg.ranks}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.s3:
        return run_s3(s3_config(a), a.keep)
    cfg = parse_args(argv)
    started = time.time()
    cfg.work_dir = cfg.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    os.makedirs(cfg.work_dir, exist_ok=True)
    parent = cfg.remote_dir or cfg.work_dir
    os.makedirs(parent, exist_ok=True)
    cfg.remote_dir = tempfile.mkdtemp(prefix="ckpt-bench-remote-", dir=parent)
    try:
        results = run_all(cfg)
        print(report(cfg, results, started), flush=True)
    finally:
        discard_link(cfg.link)
        if not cfg.keep:
            shutil.rmtree(cfg.remote_dir, ignore_errors=True)
            shutil.rmtree(cfg.work_dir, ignore_errors=True)
    return 0


def run_s3(cfg: S3Config, keep: bool) -> int:
    cfg.work_dir = cfg.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-s3-")
    os.makedirs(cfg.work_dir, exist_ok=True)
    try:
        print(main_s3(cfg), flush=True)
    finally:
        if not keep:
            shutil.rmtree(cfg.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
