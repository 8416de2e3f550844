"""Checkpoint peers over real S3: what torch.save, DCP and unbroken cost a training job.

Every row saves the same FSDP2 + Adam state from real gloo ranks to the same real S3
server (SeaweedFS on loopback, or behind the 20 ms delay line with ``--profile far``),
each through the client its users would pick: torch.save on rank 0 + boto3, dcp.save and
dcp.async_save with s3torchconnector's S3StorageWriter (and dcp.save with torch's own
FsspecWriter over s3fs, to show which writer is the better one), and
unbroken.CheckpointManager("s3://..."). The loop and its figures are bench/checkpoint/saves.py's
(bench.checkpoint.job.run_row); only where the bytes go differs. See bench/README.md.

    python -m bench.peers.checkpoints --quick                # a few minutes, small state
    python -m bench.peers.checkpoints                        # 1 GiB params + Adam, 2 ranks
    python -m bench.peers.checkpoints --profile far
    python -m bench.peers.checkpoints --scaling --plot DIR   # the curves (size x ranks)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from bench.checkpoint.measure import GiB, in_row_extra
from bench.checkpoint.rows import BASELINES
from bench.checkpoint.s3rows import S3_ROWS, S3Config, aws_env, delete_prefix
from bench.checkpoint.saves import baseline_loop, check_loop_args, run_all
from bench.common.s3remote import PROFILES, S3Remote

PEER_ROWS = tuple(cls.key for cls in S3_ROWS)
TITLES = {cls.key: cls.title for cls in S3_ROWS} | {
    "baseline": "no saves",
    "baseline_end": "no saves (again)",
}
BEST_PEER = "s3_dcp_async"
"""The peer of the scaling curves: DCP's asynchronous save with the faster S3 writer."""
SCALING_ROWS = (BEST_PEER, "s3_unbroken")
SIZES_GIB = (0.25, 0.5, 1.0, 2.0)
"""State sizes of the scaling curves (GiB of parameters + Adam's two moments: 3x the params)."""
ADAM_STATE_FACTOR = 3
RANKS = (1, 2, 4)
VOLUME_MAX = 600
"""The server's room in 64 MB volumes (~38 GB): a row of the largest point fits."""

COLUMNS = [  # (result key, title, divisor, digits)
    ("blocked_s", "loop blocked s/save", 1.0, 3),
    ("extra_s", "extra wall s/save", 1.0, 3),
    ("in_row_extra_s", "extra in run s/save", 1.0, 3),
    ("commit_s", "to commit s", 1.0, 2),
    ("restore_durable_s", "restore from S3 s", 1.0, 2),
    ("restore_local_s", "restore from node s", 1.0, 2),
    ("peak_pss", "peak memory/rank GiB", GiB, 2),
]


# -- the pure part: figures per save, the table, the JSON ---------------------------------


def add_extra_per_save(results: dict[str, dict], saves: int) -> None:
    """Per save, two ways: ``extra_s``, how much longer each row's loop ran than the
    no-saves loop; ``in_row_extra_s``, what its save steps and the steps with a save in
    flight took beyond the mean of its own quiet steps (bench/checkpoint/saves.py's "lost in
    run": blind to a slowdown that outlasts a save, but not to the drift between runs
    minutes apart, which on a shared machine can exceed a save's cost)."""
    base, _ = baseline_loop(results)
    for key, r in results.items():
        if key in BASELINES or r.get("error"):
            continue
        if base is not None and r.get("loop_s") is not None:
            r["extra_s"] = (r["loop_s"] - base) / saves
        if r.get("step_ends_s") and r.get("every") and r.get("commit_s") is not None:
            r["in_row_extra_s"] = in_row_extra(r["step_ends_s"], r["every"], r["commit_s"])


def _cell(value: Any, divisor: float, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value / divisor:.{digits}f}"


def format_table(results: dict[str, dict], order: Sequence[str]) -> str:
    """One aligned table, a row per key of ``order``; a failed row shows n/a and why."""
    header = ["row", *(c[1] for c in COLUMNS)]
    body, notes = [], []
    for key in order:
        r = results.get(key) or {"error": "not run"}
        title = TITLES.get(key, key)
        if r.get("error"):
            body.append([title, *("n/a" for _ in COLUMNS)])
            notes.append(f"  {title}: n/a: {r['error']}")
            continue
        body.append([title, *(_cell(r.get(k), d, n) for k, _, d, n in COLUMNS)])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        rest = (cell.rjust(w) for cell, w in zip(line[1:], widths[1:]))
        return "  ".join([line[0].ljust(widths[0]), *rest])

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body), *notes])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _get(results: dict[str, dict], key: str, figure: str) -> float | None:
    r = results.get(key) or {}
    return None if r.get("error") else r.get(figure)


def summary(results: dict[str, dict], put_s: float | None) -> dict[str, Any]:
    """Each row's compared figures and the ratios a reader asks for first."""
    rows = {}
    for key, r in results.items():
        if r.get("error"):
            rows[key] = {"error": r["error"]}
            continue
        rows[key] = {k: r.get(k) for k, *_ in COLUMNS if r.get(k) is not None}
        if "peak_pss" in rows[key]:
            rows[key]["peak_pss"] = rows[key]["peak_pss"] / GiB
    ub = "s3_unbroken"
    return {
        "rows": rows,
        "extra_best_peer_over_unbroken": _ratio(
            _get(results, BEST_PEER, "extra_s"), _get(results, ub, "extra_s")
        ),
        "extra_torch_save_over_unbroken": _ratio(
            _get(results, "s3_torch_save", "extra_s"), _get(results, ub, "extra_s")
        ),
        "in_run_extra_best_peer_over_unbroken": _ratio(
            _get(results, BEST_PEER, "in_row_extra_s"), _get(results, ub, "in_row_extra_s")
        ),
        "commit_unbroken_over_best_peer": _ratio(
            _get(results, ub, "commit_s"), _get(results, BEST_PEER, "commit_s")
        ),
        "commit_unbroken_over_raw_put": _ratio(_get(results, ub, "commit_s"), put_s),
        "restore_unbroken_over_best_peer": _ratio(
            _get(results, ub, "restore_durable_s"), _get(results, BEST_PEER, "restore_durable_s")
        ),
        "writer_s3torchconnector_over_fsspec_extra": _ratio(
            _get(results, "s3_dcp_save", "extra_s"),
            _get(results, "s3_dcp_save_fsspec", "extra_s"),
        ),
    }


def scaling_points(
    results: dict[str, dict], size_gb: float, params_gb: float, ranks: int, saves: int
) -> list[dict]:
    """One point per row of a scaling run: its size, ranks, the plotted figures, and the
    noise (how far its two no-saves loops differ, per save)."""
    _, spread = baseline_loop(results)
    noise = None if spread is None else spread / saves
    model_peaks = [_get(results, k, "peak_pss") for k in BASELINES]
    model_peak = max((p for p in model_peaks if p is not None), default=None)
    points = []
    for key in SCALING_ROWS:
        r = results.get(key) or {"error": "not run"}
        peak = _get(results, key, "peak_pss")
        points.append(
            {
                "row": key,
                "size_gib": size_gb,
                "params_gib": params_gb,
                "state_gib": (r.get("state_bytes") or 0) / GiB or None,
                "ranks": ranks,
                "blocked_s": _get(results, key, "blocked_s"),
                "extra_s": _get(results, key, "extra_s"),
                "in_row_extra_s": _get(results, key, "in_row_extra_s"),
                "commit_s": _get(results, key, "commit_s"),
                "noise_s": noise,
                "peak_gib": None if peak is None else peak / GiB,
                "model_peak_gib": None if model_peak is None else model_peak / GiB,
                "error": r.get("error"),
            }
        )
    return points


def format_scaling(points: Sequence[dict]) -> str:
    """One line per row and point; peak memory beside the no-saves run's (the model alone),
    so a row's snapshots read as the difference."""
    lines = [
        f"{'row':34} {'params GiB':>10} {'state GiB':>9} {'ranks':>5} "
        f"{'loop blocked s/save':>19} {'extra wall s/save':>17} {'extra in run s/save':>19} "
        f"{'to commit s':>11} {'noise s/save':>12} {'peak GiB/rank':>13} {'no saves GiB':>12}"
    ]
    for p in points:
        state = "n/a" if p["state_gib"] is None else f"{p['state_gib']:.3f}"
        lines.append(
            f"{TITLES.get(p['row'], p['row']):34} {p['params_gib']:>10.3g} {state:>9} "
            f"{p['ranks']:>5} {_cell(p.get('blocked_s'), 1.0, 3):>19} "
            f"{_cell(p['extra_s'], 1.0, 3):>17} "
            f"{_cell(p['in_row_extra_s'], 1.0, 3):>19} {_cell(p['commit_s'], 1.0, 2):>11} "
            f"{_cell(p.get('noise_s'), 1.0, 3):>12} {_cell(p.get('peak_gib'), 1.0, 2):>13} "
            f"{_cell(p.get('model_peak_gib'), 1.0, 2):>12}"
            + (f"  ({p['error']})" if p.get("error") else "")
        )
    return "\n".join(lines)


def json_line(payload: dict[str, Any]) -> str:
    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return None if math.isnan(v) else round(v, 4)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(payload), sort_keys=True)


# -- plots ---------------------------------------------------------------------------------


def plot_rows(results: dict[str, dict], order: Sequence[str], path: str, title: str) -> str:
    """Bars per row: loop blocked, extra wall per save, to commit, restore from S3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [c for c in COLUMNS if c[0] != "peak_pss"]
    keys = [k for k in order if k not in BASELINES]
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 4))
    for ax, (figure, label, divisor, _) in zip(axes, figures):
        values = [(_get(results, k, figure) or 0.0) / divisor for k in keys]
        colors = ["tab:orange" if k == "s3_unbroken" else "tab:blue" for k in keys]
        ax.barh([TITLES.get(k, k) for k in keys], values, color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scaling(points: Sequence[dict], directory: str) -> list[str]:
    """Two PNGs: each figure against state size (a line per row and ranks), and against
    ranks (a line per row and size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []
    good = [p for p in points if not p.get("error") and p["state_gib"]]
    for along, other, name in (
        ("state_gib", "ranks", "checkpoint_scaling_size.png"),
        ("ranks", "size_gib", "checkpoint_scaling_ranks.png"),
    ):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        panels = (
            ("extra_s", "extra wall s/save (against no saves)"),
            ("in_row_extra_s", "extra in run s/save"),
            ("commit_s", "to commit s"),
        )
        for ax, (figure, label) in zip(axes, panels):
            for row in SCALING_ROWS:
                values = sorted({p[other] for p in good if p["row"] == row})
                shades = plt.get_cmap("Oranges" if row == "s3_unbroken" else "Blues")
                for n, value in enumerate(values):
                    line = sorted(
                        (p[along], p[figure])
                        for p in good
                        if p["row"] == row and p[other] == value and p[figure] is not None
                    )
                    if not line:
                        continue
                    xs, ys = zip(*line)
                    style = "-o" if row == "s3_unbroken" else "--s"
                    unit = "ranks" if other == "ranks" else "GiB state"
                    color = shades(0.45 + 0.5 * (n + 1) / len(values))
                    ax.plot(xs, ys, style, color=color, label=f"{TITLES[row]}, {value:g} {unit}")
            ax.set_xscale("log", base=2)
            ticks = sorted({p[along] for p in good})
            ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("state GiB (params + Adam)" if along == "state_gib" else "ranks")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# -- running it ----------------------------------------------------------------------------


class Vacuum:
    """Asks SeaweedFS's master to compact deleted objects, between rows only.

    Deleted objects keep their room in the server's volumes until compacted, and a full
    run writes far more than the volumes hold. A run that compacted every 30 s while
    rows uploaded once saw a part upload answered 500 on all 10 retries; a volume is
    read-only while it is compacted, so now it never runs while ranks run.
    """

    def __init__(self, remote: S3Remote) -> None:
        args = remote.server.proc.args
        port = next(a.split("=", 1)[1] for a in args if a.startswith("-master.port="))
        self.url = f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.2"
        self.count = 0

    def once(self) -> None:
        try:
            urllib.request.urlopen(self.url, timeout=300).read()
            self.count += 1
        except OSError as e:
            print(f"[checkpoint peers] vacuum failed: {e}", file=sys.stderr)


def raw_put_bandwidth(remote: S3Remote, nbytes: int) -> float:
    """Bytes/s of obstore's multipart put of ``nbytes`` from memory: the floor of a commit."""
    import obstore
    from obstore.store import S3Store

    root = remote.new_root()
    bucket, prefix = root.split("/", 1)
    opts = remote.server.storage_options
    store = S3Store(
        bucket,
        endpoint=remote.endpoint_url,
        access_key_id=opts["key"],
        secret_access_key=opts["secret"],
        region="us-east-1",
        client_options={"allow_http": True},
    )
    blob = os.urandom(nbytes)
    t0 = time.perf_counter()
    obstore.put(store, f"{prefix}/probe", blob, chunk_size=16 << 20, max_concurrency=8)
    seconds = time.perf_counter() - t0
    obstore.delete(store, f"{prefix}/probe")
    return nbytes / seconds


def run_rows(
    args: argparse.Namespace,
    remote: S3Remote,
    params_gb: float,
    ranks: int,
    rows: Sequence[str],
    put_bps: float,
    vacuum: Vacuum,
) -> tuple[dict[str, dict], S3Config]:
    """One benchmark run of ``rows`` (after the no-saves baseline) at one size and rank count.

    After each row its objects are deleted and the server compacted, so the next row
    starts on an empty, compacted server whatever the run's size."""
    keys = ["baseline", *rows, "baseline_end"]  # twice: how far two loops differ (noise)
    work = tempfile.mkdtemp(prefix="ckpt-peers-", dir=args.work_dir)
    cfg = S3Config(
        params_gb=params_gb,
        ranks=ranks,
        saves=args.saves,
        every=args.every,
        batch=args.batch,
        rows=tuple(keys),
        isolate=args.isolate,
        latency=remote.latency_ms / 1000,
        bandwidth=put_bps,
        link=f"ckpt-peers-{os.getpid()}",
        work_dir=work,
        remote_dir=os.path.join(work, "remote"),
        pg_timeout_s=300.0 if args.quick else 1800.0,
        row_timeout_s=args.row_timeout,
        quick=args.quick,
        s3_root=remote.new_root(),
        s3_options=remote.storage_options,
        profile=args.profile,
    )
    os.makedirs(cfg.remote_dir, exist_ok=True)
    try:

        def between_rows() -> None:
            delete_prefix(f"s3://{cfg.s3_root}")
            vacuum.once()

        results = run_all(cfg, between_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    add_extra_per_save(results, cfg.saves)
    return results, cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small state, 2 saves: a few minutes")
    p.add_argument("--profile", choices=sorted(PROFILES), default="loopback")
    p.add_argument("--params-gb", type=float, default=None, help="GiB of params (1; quick 1/16)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=None, help="timed saves per row (5; quick 2)")
    p.add_argument("--every", type=int, default=None, help="steps between saves (auto)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", default=",".join(PEER_ROWS), help="comma-separated subset")
    p.add_argument("--scaling", action="store_true", help="the curves instead of the table")
    p.add_argument("--sizes", default=None, help="GiB of state (params + Adam), --scaling")
    p.add_argument("--ranks-list", default=None, help="ranks for --scaling (1,2,4)")
    p.add_argument("--plot", metavar="DIR", default=None, help="write PNG plots into DIR")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="fresh rank processes per row (default: on, off with --quick)")  # fmt: skip
    p.add_argument("--work-dir", default=None, help="scratch parent directory (temp dir)")
    p.add_argument("--row-timeout", type=float, default=None, help="seconds per row")
    a = p.parse_args(argv)
    a.rows = [k.strip() for k in a.rows.split(",") if k.strip()]
    unknown = [k for k in a.rows if k not in PEER_ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(PEER_ROWS)}")

    def numbers(text: str | None, default: Sequence[float], kind: type) -> list:
        try:
            values = [kind(v) for v in text.split(",")] if text else list(default)
        except ValueError:
            p.error(f"not a comma-separated list of {kind.__name__}: {text!r}")
        if not values or any(v <= 0 for v in values):
            p.error(f"values must be positive, got {text!r}")
        return values

    quick_sizes = (0.1, 0.2)
    a.sizes = numbers(a.sizes, quick_sizes if a.quick else SIZES_GIB, float)
    a.ranks_list = numbers(a.ranks_list, (1, 2) if a.quick else RANKS, int)
    check_loop_args(p, a)
    needs_connector = {"s3_dcp_save", "s3_dcp_async"} & set(SCALING_ROWS if a.scaling else a.rows)
    if needs_connector and importlib.util.find_spec("s3torchconnector") is None:
        p.error(
            f"rows {sorted(needs_connector)} need s3torchconnector: "
            'pip install "torch==2.13.0" -e ".[bench]" (or make bench-deps)'
        )
    if a.ranks < 1:
        p.error(f"--ranks must be >= 1, got {a.ranks}")
    a.params_gb = a.params_gb or (1 / 16 if a.quick else 1.0)
    a.saves = a.saves or (2 if a.quick else 5)
    a.isolate = (not a.quick) if a.isolate is None else a.isolate
    a.row_timeout = a.row_timeout or (600.0 if a.quick else 3600.0)
    return a


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_before = time.time(), _load()
    remote = S3Remote.profile(args.profile, volume_max=VOLUME_MAX)
    opts = remote.server.storage_options
    os.environ.update(aws_env(remote.endpoint_url, opts["key"], opts["secret"]))
    try:
        put_bps = raw_put_bandwidth(remote, (64 << 20) if args.quick else (256 << 20))
        vacuum = Vacuum(remote)
        if args.scaling:
            payload, text = _scaling(args, remote, put_bps, vacuum)
        else:
            payload, text = _table(args, remote, put_bps, vacuum)
        payload.update(
            profile=args.profile,
            remote=remote.describe(),
            raw_put_mb_s=put_bps / 1e6,
            proxy_cpu_s=remote.proxy_cpu_seconds(),
            load_avg_before=load_before,
            load_avg_after=_load(),
            cpus=os.cpu_count(),
            quick=args.quick,
            seconds=time.time() - started,
            vacuums=vacuum.count,
        )
        print(text)
        print(
            f"load average before {load_before}, after {payload['load_avg_after']} "
            f"({os.cpu_count()} CPUs); {time.time() - started:.0f} s in all"
        )
        print(json_line(payload), flush=True)
    finally:
        remote.close()
    return 0


def _table(args: argparse.Namespace, remote: S3Remote, put_bps: float, vacuum: Vacuum):
    results, cfg = run_rows(args, remote, args.params_gb, args.ranks, args.rows, put_bps, vacuum)
    any_row = next((r for r in results.values() if r.get("state_bytes")), {})
    state = any_row.get("state_bytes", 0)
    put_s = state / put_bps if state else None
    order = [*cfg.rows]
    head = [
        f"checkpoint peers over real S3: {cfg.ranks} ranks (gloo, FSDP2, Adam), state "
        f"{state / GiB:.3f} GiB in all (params {cfg.params_gb:g} GiB + Adam), "
        f"{cfg.saves} saves every {cfg.every} steps",
        f"remote: {remote.describe()}; a raw multipart put (obstore, one process, measured "
        f"once before the rows) of the same bytes takes {put_s or 0:.2f} s "
        f"({put_bps / 1e6:.0f} MB/s)",
        "loop blocked: time inside the save calls; extra wall: how much longer the loop ran "
        "than with no saves, per save; extra in run: its save steps and the steps with a "
        "save in flight against its own quiet steps, per save (immune to drift between "
        "runs); to commit: one save at rest until every byte is durable; restore from S3: "
        "into the live model, checked byte for byte; restore from node: the same from the "
        "node's own copy (unbroken: its memory tier, or its disk tier where that row says "
        "so); peak memory: the largest rank's PSS "
        "with its helper processes (the model itself included), plus its share of "
        "unbroken's memory-tier files (shared memory no process maps)",
        "",
    ]
    if not cfg.isolate:
        head.insert(-1, "rows share their rank processes (--no-isolate): a row's peak memory "
                    "includes heap that earlier rows left behind")  # fmt: skip
    base, spread = baseline_loop(results)
    if spread is not None:
        head.insert(-1, f"the two no-saves runs differ by {spread / cfg.saves:.3f} s/save (noise)")
    title = (
        f"{cfg.ranks} ranks, {state / GiB:.2f} GiB state, {args.profile} S3 "
        f"({time.strftime('%Y-%m-%d')})"
    )
    text = "\n".join([*head, format_table(results, order)])
    payload: dict[str, Any] = {
        "bench": "checkpoint_peers",
        "ranks": cfg.ranks,
        "state_gib": state / GiB,
        "saves": cfg.saves,
        "every": cfg.every,
        "noise_s_per_save": None if spread is None else spread / cfg.saves,
        "baseline_loop_s": base,
        **summary(results, put_s),
    }
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        name = f"checkpoint_peers_{args.profile}.png"
        payload["plots"] = [plot_rows(results, order, os.path.join(args.plot, name), title)]
    return payload, text


def _scaling(args: argparse.Namespace, remote: S3Remote, put_bps: float, vacuum: Vacuum):
    points: list[dict] = []
    for state_gb in args.sizes:
        params_gb = state_gb / ADAM_STATE_FACTOR
        for ranks in args.ranks_list:
            print(f"[checkpoint peers] {state_gb:g} GiB state, {ranks} ranks", file=sys.stderr)
            results, _ = run_rows(args, remote, params_gb, ranks, SCALING_ROWS, put_bps, vacuum)
            points += scaling_points(results, state_gb, params_gb, ranks, args.saves)
    text = "\n".join(
        [
            f"checkpoint scaling over real S3 ({remote.describe()}): "
            f"{TITLES[BEST_PEER]} against unbroken, {args.saves} saves per point",
            "",
            format_scaling(points),
        ]
    )
    payload: dict[str, Any] = {"bench": "checkpoint_peers_scaling", "points": points}
    if args.plot:
        payload["plots"] = plot_scaling(points, args.plot)
    return payload, text


if __name__ == "__main__":
    sys.exit(main())
