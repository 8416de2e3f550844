"""What one unbroken save costs the training steps around it, measured in pairs.

bench/checkpoint/saves.py compares rows run minutes apart, and on these machines the training
loop drifts between them by more than a save costs. This probe keeps everything in one
job: the checkpoint benchmark's model and step on 2 gloo ranks, one CheckpointManager
throughout (as in its unbroken row), training in blocks of ``--block`` steps. Each pair
is one block with a save issued after its first step, while training goes on, and one
block without, in the order ABBA (save/none, none/save, ...) so that a steady drift
cancels. Per step position the difference between the two blocks is what the save
cost; over pairs the report gives it with a standard error:

- in flight: the save call's own seconds, then the steps after it until the commit
  (checkpoint.py's "lost in run"; the rest of the step that makes the call ran before
  the save existed, so its difference is noise and is left out);
- after the commit: the rest of the block (a lasting cost would show here);
- the whole block: both, the figure to hold against torch.save / 50.

``--also floor_2tier`` adds a third block to every round, saved by the checkpoint
benchmark's "floor + 2 disk writes" row (a memcpy, then the bytes written once to each
tier's disk): the least a two-tier save costs on this machine, measured in the same
rounds, with unbroken's difference from it. ``--also unbroken_shared`` does the same
for unbroken with its staging buffers in shared memory (the default before private
huge-page memory). Orders alternate forward and backward.

    python -m bench.checkpoint.pairs --quick            # tiny state, about a minute
    python -m bench.checkpoint.pairs --minutes 60       # full size until an hour is up
    python -m bench.checkpoint.pairs --from-log F.jsonl # report again from a kept log
    python -m bench.checkpoint.pairs --from-log F.jsonl --from-log G.jsonl  # pooled
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.checkpoint.job import WARM_UP_SAVES, Config, build, join_ranks, train_step, train_untimed
from bench.checkpoint.pairs_math import (
    Estimate,
    difference,
    pairs_from_records,
    summarize,
    whole_rounds,
)
from bench.checkpoint.rows import (
    MemcpyFloor,
    Row,
    RowContext,
    TwoTierFloor,
    Unbroken,
    UnbrokenSharedStaging,
)
from bench.checkpoint.saves import free_port
from unbroken.storage.link import discard_link

SETTLE_STEPS = 3
"""Untimed steps between the warm-up saves and the first pair (as in the probe whose log
results/pairs-6366f39.jsonl is)."""
NEVER_DUE = 10**9
ALSO = {cls.key: cls for cls in (MemcpyFloor, TwoTierFloor, UnbrokenSharedStaging)}
"""Other ways of saving a round can also hold, by the benchmark's row keys."""


def _block(
    kind: str,
    row: Row | None,
    model: Any,
    optim: Any,
    width: int,
    cfg: Config,
    gen: Any,
    first_step: int,
    block: int,
) -> dict[str, Any]:
    """Train ``block`` steps, with ``row`` saving after the first (None: no save); the
    times."""
    dist.barrier()
    t0 = time.perf_counter()
    ends: list[float] = []
    save_at = call = None
    for i in range(block):
        train_step(model, width, cfg.batch, gen)
        if row is not None:
            row.before_optim_step()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if row is not None and i == 0:
            called = time.perf_counter()
            row.save(first_step)
            save_at = time.perf_counter() - t0
            call = save_at - (called - t0)
        ends.append(time.perf_counter() - t0)
    dist.barrier()
    commit = None
    if row is not None:
        row.drain()  # outside the timed steps: a block shorter than the commit waits here
        commit = row.last_commit_seconds
    steps = [b - a for a, b in zip([0.0, *ends[:-1]], ends)]
    return {"kind": kind, "steps": steps, "save_at": save_at, "call": call, "commit": commit}


def rank_main(
    rank: int,
    cfg: Config,
    pairs: int,
    block: int,
    stop_at: float,
    log: str,
    port: int,
    also: tuple[str, ...] = (),
) -> None:
    join_ranks(rank, cfg, port)
    try:
        model, optim, width = build(cfg)
        gen = torch.Generator().manual_seed(100 + rank)
        train_untimed(model, optim, width, cfg.batch, gen, 2)  # creates Adam's state
        remote = os.path.join(cfg.remote_dir, "unbroken")
        os.makedirs(remote, exist_ok=True)
        ctx = RowContext(
            model,
            optim,
            rank,
            NEVER_DUE,
            remote,
            os.path.join(cfg.work_dir, "unbroken"),
            cfg.remote_options,
        )
        row = Unbroken(ctx)
        rows: dict[str, Row | None] = {"save": row, "none": None}
        for key in also:
            other = dataclasses.replace(
                ctx,
                row_dir=os.path.join(cfg.remote_dir, key),
                work_dir=os.path.join(cfg.work_dir, key),  # its own local tier
            )
            os.makedirs(other.row_dir, exist_ok=True)
            rows[key] = ALSO[key](other)
        for step in range(WARM_UP_SAVES):
            for saver in rows.values():
                if saver is not None:
                    saver.save(step)
                    saver.drain()
        train_untimed(model, optim, width, cfg.batch, gen, SETTLE_STEPS)
        step = WARM_UP_SAVES
        stop = torch.zeros(1)
        for index in range(pairs):
            stop[0] = float(rank == 0 and time.time() > stop_at)
            dist.broadcast(stop, 0)
            if stop[0]:
                break
            kinds = list(rows)
            for kind in kinds if index % 2 == 0 else kinds[::-1]:
                rec = _block(kind, rows[kind], model, optim, width, cfg, gen, step + 1, block)
                step += block
                if rank == 0:
                    with open(log, "a") as f:
                        f.write(json.dumps({"pair": index, **rec}) + "\n")
                    print(
                        f"[pairs] pair {index} {kind}: {sum(rec['steps']):.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        for saver in rows.values():
            if saver is not None:
                saver.close()
    finally:
        dist.destroy_process_group()


def _rounded(e: Estimate) -> dict[str, float | None]:
    return {
        "mean": round(e.mean, 4),
        "se": None if e.se is None else round(e.se, 4),
        "median": round(e.median, 4),
    }


def report(records: list[dict], dropped: str) -> str:
    """unbroken's cost per save from a probe's records, then that of every other way of
    saving the rounds also held, and unbroken's difference from it; all of them over the
    rounds that hold every kind of block. ``dropped`` says which pairs were left out."""
    records = whole_rounds(records)
    pairs = pairs_from_records(records, 0)
    s = summarize(pairs)
    per = s["per_position"]
    plain = [x for pair in pairs for x in pair.without]
    timed_call = all("call" in r for r in records if r["kind"] != "none")
    lines = [
        f"save cost, block with a save minus block without, over {len(pairs)} pairs "
        f"({dropped}); mean ± standard error (median), "
        "seconds per save",
        f"a step without a save: {sum(plain) / len(plain):.3f} s on average",
        "per step position: " + "  ".join(f"{i}: {e}" for i, e in enumerate(per)),
        f"  in flight (save call to commit): {s['in_flight']}"
        + ("" if timed_call else "  (this log has no save call times: 0 s taken for the call)"),
        f"  after the commit:                {s['after_commit']}",
        f"  whole block:                     {s['whole_block']}",
    ]
    out: dict[str, Any] = {k: _rounded(v) for k, v in s.items() if isinstance(v, Estimate)}
    out["pairs"] = len(pairs)
    others = dict.fromkeys(r["kind"] for r in records if r["kind"] not in ("save", "none"))
    for kind in others:
        title = ALSO[kind].title if kind in ALSO else kind
        theirs = summarize(pairs_from_records(records, 0, kind))
        gap = difference(records, 0, "save", kind)
        lines += [
            f"{title}, the same way:",
            f"  in flight:                       {theirs['in_flight']}",
            f"  whole block:                     {theirs['whole_block']}",
            f"  unbroken minus {title}, whole block: {gap}",
        ]
        out[kind] = {k: _rounded(theirs[k]) for k in ("in_flight", "whole_block")}
        out[f"save_minus_{kind}"] = _rounded(gap)
    lines.append(json.dumps(out, sort_keys=True))
    return "\n".join(lines)


def report_log(paths: str | list[str], skip: int) -> str:
    """The report of a probe's log, or of several pooled into one (runs of the same code
    on different days); a log that cannot give one is refused by name."""
    paths = [paths] if isinstance(paths, str) else paths
    try:
        logs = []
        for path in paths:
            with open(path) as f:
                logs.append([json.loads(line) for line in f if line.strip()])
        each = "" if len(logs) == 1 else f" of each of {len(logs)} logs"
        return report(pooled(logs, skip), f"first {skip}{each} dropped")
    except (OSError, ValueError, KeyError, TypeError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise SystemExit(f"checkpoint_pairs: cannot report {', '.join(paths)}: {detail}") from e


def pooled(logs: list[list[dict]], skip: int) -> list[dict]:
    """The records of several logs as one: the first ``skip`` pairs of each dropped (each
    job's first blocks run while the machine settles); the first log keeps its pair
    numbers, the others' are numbered on after it."""
    records: list[dict] = []
    for log in logs:
        shift = 1 + max(r["pair"] for r in records) - skip if records else 0
        records += [{**r, "pair": r["pair"] + shift} for r in log if r["pair"] >= skip]
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-gb", type=float, default=1.0, help="GiB of fp32 parameters (1)")
    p.add_argument("--pairs", type=int, default=20, help="pairs of blocks, at most (20)")
    p.add_argument("--block", type=int, default=10, help="steps per block (10)")
    p.add_argument("--minutes", type=float, default=None, help="start no pair after this")
    p.add_argument("--skip", type=int, default=1, help="first pairs left out of the report (1)")
    p.add_argument("--work-dir", default="", help="scratch directory (a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--quick", action="store_true", help="tiny state, 2 pairs of 3 steps")
    p.add_argument(
        "--from-log",
        action="append",
        default=[],
        help="report from a kept log, run nothing; given more than once, the logs pooled",
    )
    p.add_argument(
        "--also",
        default="",
        help=f"comma-separated other savers each round also holds: {', '.join(ALSO)}",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.params_gb, a.pairs, a.block, a.skip = 0.02, 2, 3, 0
    for name in ("pairs", "block"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.skip < 0 or (not a.from_log and a.skip >= a.pairs):
        p.error(f"--skip must be 0..{a.pairs - 1} (fewer than --pairs)")
    if a.params_gb <= 0:
        p.error("--params-gb must be positive")
    a.also = tuple(k for k in a.also.split(",") if k)
    unknown = [k for k in a.also if k not in ALSO]
    if unknown:
        p.error(f"--also: no saver {', '.join(unknown)}; there are {', '.join(ALSO)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.from_log:
        print(report_log(a.from_log, a.skip))
        return 0
    work = a.work_dir or tempfile.mkdtemp(prefix="ckpt-pairs-")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "pairs.jsonl")
    if os.path.exists(log):
        raise SystemExit(f"{log} exists: pick another --work-dir, or report it with --from-log")
    cfg = Config(
        params_gb=a.params_gb,
        quick=a.quick,
        work_dir=work,
        remote_dir=os.path.join(work, "remote"),
        link=f"ckpt-pairs-{os.getpid()}",
    )
    stop_at = time.time() + a.minutes * 60 if a.minutes else float("inf")
    try:
        mp.start_processes(
            rank_main,
            args=(cfg, a.pairs, a.block, stop_at, log, free_port(), a.also),
            nprocs=cfg.ranks,
            start_method="spawn",
        )
        print(f"log: {log}" if a.keep else "log: not kept (--keep keeps it)")
        print(report_log(log, a.skip))
    finally:
        discard_link(cfg.link)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
