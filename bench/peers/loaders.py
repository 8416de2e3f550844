"""unbroken beside the data loaders users would pick instead, over one real S3 server.

Rows (same JPEGs, same decode + augmentation, batch size and worker count, one run):
  stock         torch.utils.data.DataLoader, boto3 get_object per item
  unbroken      ub.VolumeDataset("s3://...") + ub.DataLoader
  stateful      torchdata's StatefulDataLoader over the same boto3 dataset
  streaming     MosaicML Streaming after converting to MDS (conversion timed apart)
  litdata       LitData after optimize() (conversion timed apart)
  litdata_raw   LitData's StreamingRawDataset over the files as they are (own copy: it
                writes an index file into the dataset's prefix)

Columns: epoch 1 and 2 images/s (after the first batch), epoch 1's seconds from start to
end (the first batch's wait included), time to the first batch, conversion seconds, the
time from raw files to the end of epoch 1 (conversion plus epoch 1: what a user with a
new dataset waits before a first epoch is done), peak
local disk of the loader's cache, CPU ms per image, and measured correctness: every
sample's bytes checked against the source, duplicates and missing samples in an epoch,
and after a mid-epoch save resumed at another worker count and at world size 2.

The peers' pins fight ours, so every row runs in a subprocess of their own virtualenv:

    python -m bench.peers.loaders --setup    # once: <checkout>/../.venv-peers (or --venv)
    python -m bench.peers.loaders --quick                 # a few minutes, loopback and far
    python -m bench.peers.loaders --profile both --scaling --plot docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common.paths import ROOT, child_env, module_argv
from bench.peers.accounting import resume_cell
from bench.peers.setup import DEFAULT_VENV, setup_venv, venv_python

ROWS = ("stock", "unbroken", "stateful", "streaming", "litdata", "litdata_raw")
LABELS = {
    "stock": "stock DataLoader + boto3",
    "unbroken": "unbroken",
    "stateful": "torchdata StatefulDataLoader + boto3",
    "streaming": "MosaicML Streaming (MDS)",
    "litdata": "LitData optimize()",
    "litdata_raw": "LitData StreamingRawDataset",
}
PLOT_LABELS = {
    "stock": "stock\n+ boto3",
    "unbroken": "unbroken",
    "stateful": "torchdata\nStatefulDataLoader",
    "streaming": "Streaming\n(MDS)",
    "litdata": "LitData\noptimize()",
    "litdata_raw": "LitData\nraw files",
}
PREFIXES = {"files": "files", "raw": "raw-litdata"}
"""Where the source JPEGs go; LitData's raw dataset gets a copy of its own."""


# -- the report (pure) ---------------------------------------------------------------------


def _size(n: int | None) -> str:
    if not n:
        return "0"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


TITLES = (
    "loader", "e1 img/s", "e2 img/s", "e1 s", "first batch s", "convert s", "raw to e1 end s",
    "peak cache",
    "CPU ms/img e1", "e2", "bad bytes", "epoch", "resume workers", "resume world 1->2",
)  # fmt: skip


def row_cells(result: dict[str, Any]) -> list[str]:
    """One row of the table from a row's measurements (or its error)."""
    label = LABELS.get(result["row"], result["row"])
    if "error" in result:
        return [label, *["-"] * (len(TITLES) - 2), f"error: {result['error']}"]
    e1, e2 = result.get("epoch1", {}), result.get("epoch2", {})
    check = result.get("epoch_check") or {}
    conversion = result.get("conversion_s")
    return [
        label,
        f"{e1.get('rate', 0):.0f}",
        f"{e2['rate']:.0f}" if e2 else "-",
        f"{e1.get('seconds', 0):.1f}",
        f"{e1.get('first_batch_s', 0):.2f}",
        f"{conversion:.1f}" if conversion is not None else "-",
        f"{(conversion or 0) + e1.get('seconds', 0):.1f}",
        _size(result.get("peak_cache_bytes")),
        f"{e1.get('cpu_ms', 0):.2f}",
        f"{e2['cpu_ms']:.2f}" if e2 else "-",
        str(check.get("mismatched", "-")),
        resume_cell(check),
        resume_cell(result.get("resume_workers"), whole=True),
        resume_cell(result.get("resume_world"), whole=True),
    ]


def table(results: list[dict[str, Any]]) -> str:
    """The rows side by side, columns aligned; a long reason becomes a numbered note."""
    notes: list[str] = []

    def noted(cell: str) -> str:
        if len(cell) <= NOTE_AFTER:
            return cell
        notes.append(cell)
        return f"see [{len(notes)}]"

    cells = [row_cells(r) for r in results]
    lines = [list(TITLES)] + [[label, *(noted(c) for c in rest)] for label, *rest in cells]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TITLES))]
    text = "\n".join(
        "  ".join([line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:]))])
        for line in lines
    )
    return "\n".join([text, *(f"[{n}] {note}" for n, note in enumerate(notes, 1))])


NOTE_AFTER = 24
"""A cell longer than this (an error, a refusal) is printed under the table instead."""


def ratios(results: list[dict[str, Any]], against: str = "unbroken") -> dict[str, dict]:
    """unbroken's epoch rates over each other row's (> 1: unbroken leads)."""
    by_row = {r["row"]: r for r in results if "error" not in r}
    mine = by_row.get(against)
    out: dict[str, dict] = {}
    if not mine:
        return out
    for row, r in by_row.items():
        if row == against:
            continue
        out[row] = {
            f"epoch{n}": round(mine[f"epoch{n}"]["rate"] / r[f"epoch{n}"]["rate"], 2)
            for n in (1, 2)
            if r.get(f"epoch{n}", {}).get("rate") and mine.get(f"epoch{n}", {}).get("rate")
        }
    return out


# -- running the rows ----------------------------------------------------------------------


def source_crcs(root: str, keys: list[str]) -> dict[str, int]:
    from bench.peers.accounting import crc_of

    crcs = {}
    for key in keys:
        with open(os.path.join(root, key), "rb") as f:
            crcs[key] = crc_of(f.read())
    return crcs


def run_row(
    python: str, spec: dict, work_root: str, timeout: float, log: str | None = None
) -> dict[str, Any]:
    """One row in a fresh interpreter; its result, or what went wrong (its stderr: ``log``)."""
    fd, spec_path = tempfile.mkstemp(prefix=f"{spec['row']}-", suffix=".json", dir=work_root)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    env = child_env()
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    try:
        proc = subprocess.run(
            module_argv("bench.peers.loader_rows", spec_path, python=python),
            capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"row": spec["row"], "error": f"timed out after {timeout:.0f} s"}
    finally:
        os.unlink(spec_path)
    if log:
        with open(log, "a") as f:
            f.write(f"==== {spec['row']} (exit {proc.returncode})\n{proc.stderr}\n")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return {"row": spec["row"], "error": tail[-1] if tail else f"exit {proc.returncode}"}


class Bench:
    """The server, the uploaded JPEGs and the source checksums, shared by every row."""

    def __init__(self, args: argparse.Namespace) -> None:
        from bench.common.jpeg_workload import ensure_dataset, upload
        from bench.common.s3remote import CREDENTIALS, S3Remote

        self.args = args
        self.root, self.keys = ensure_dataset(args.bench_dir, args.files, 2)
        self.crcs = source_crcs(self.root, self.keys)
        self.loopback = S3Remote()
        self.server = self.loopback.server
        bucket_root = self.server.new_root()
        self.bucket_root = bucket_root
        client = self.loopback.client()
        bucket, folder = bucket_root.split("/", 1)
        for prefix in PREFIXES.values():
            upload(client, bucket, f"{folder}/{prefix}", self.root, self.keys)
        self.credentials = CREDENTIALS
        self.work = tempfile.mkdtemp(prefix="unbroken-peers-", dir=args.bench_dir)
        self.log = os.path.join(args.bench_dir, "peers-last-run.log")
        """Every row's stderr (tracebacks of a failed row or resume), newest run only."""
        open(self.log, "w").close()
        self.mean_bytes = sum(os.path.getsize(os.path.join(self.root, k)) for k in self.keys) / len(
            self.keys
        )

    def spec(self, row: str, endpoint: str, workers: int, **extra: Any) -> dict[str, Any]:
        converted = self.server.new_root()
        return {
            "row": row,
            "endpoint": endpoint,
            "key": self.credentials["key"],
            "secret": self.credentials["secret"],
            "files": f"{self.bucket_root}/{PREFIXES['files']}",
            "raw": f"{self.bucket_root}/{PREFIXES['raw']}",
            "mds": f"{converted}/mds",
            "litdata": f"{converted}/litdata",
            "keys": self.keys,
            "source_crcs": self.crcs,
            "batch_size": self.args.batch_size,
            "workers": workers,
            "work": os.path.join(self.work, f"{row}-{time.monotonic_ns()}"),
            "failed_dir": os.path.join(self.args.bench_dir, "peers-failed"),
            **extra,
        }

    def python_for(self, row: str) -> str | None:
        """Stock and unbroken run in this interpreter (unbroken as its users install it);
        the peers in their venv (torch, pillow and boto3 pinned to this one's versions)."""
        if row in ("stock", "unbroken"):
            return sys.executable
        return venv_python(self.args.venv)

    def run(self, row: str, latency_ms: float, workers: int, **extra: Any) -> dict[str, Any]:
        from bench.common.s3remote import S3Remote

        python = self.python_for(row)
        if python is None:
            return {"row": row, "error": f"no peers venv at {self.args.venv} (--setup)"}
        remote = S3Remote(latency_ms, self.server)
        try:
            spec = self.spec(row, remote.endpoint_url, workers, **extra)
            result = run_row(python, spec, self.work, self.args.row_timeout, self.log)
            result["proxy_cpu_s"] = round(remote.proxy_cpu_seconds(), 2)
        finally:
            remote.close()
        result["latency_ms"], result["workers"] = latency_ms, workers
        return result

    def close(self) -> None:
        import shutil

        self.loopback.close()
        shutil.rmtree(self.work, ignore_errors=True)


def run_profiles(bench: Bench, args: argparse.Namespace) -> dict[str, list[dict]]:
    from bench.common.s3remote import PROFILES

    profiles = ["loopback", "far"] if args.profile == "both" else [args.profile]
    out: dict[str, list[dict]] = {}
    for n, name in enumerate(profiles):
        out[name] = []
        resume = n == 0 or args.resume_every_profile  # the byte check runs in every one
        for row in args.rows:
            print(f"[{name}] {row} ...", file=sys.stderr, flush=True)
            out[name].append(bench.run(row, PROFILES[name], args.workers, resume=resume))
    return out


SCALING_WORKERS = (1, 2, 4)
SCALING_LATENCY_MS = (0.0, 5.0, 20.0, 50.0)
SCALING_MIN_BATCHES = 40
"""Fewer batches per epoch than this and a point is start-up noise (warned, not refused)."""


def best_peer(results: list[dict]) -> str | None:
    """The peer (not stock, not unbroken) with the best epoch 1 rate in the main run."""
    peers = [
        r for r in results
        if r["row"] not in ("stock", "unbroken") and "error" not in r and r.get("epoch1")
    ]  # fmt: skip
    return max(peers, key=lambda r: r["epoch1"]["rate"])["row"] if peers else None


def run_scaling(bench: Bench, rows: list[str], workers: int) -> dict[str, list[dict]]:
    """Epoch 1 images/s against workers (loopback) and against latency (``workers``)."""
    out: dict[str, list[dict]] = {"workers": [], "latency": []}
    for row in rows:
        done: dict[tuple[float, int], dict] = {}
        points = [(0.0, w) for w in SCALING_WORKERS] + [(ms, workers) for ms in SCALING_LATENCY_MS]
        for ms, w in points:
            if (ms, w) not in done:  # (0 ms, the run's workers) is on both curves: run it once
                print(f"[scaling {w} workers, +{ms:g} ms] {row} ...", file=sys.stderr, flush=True)
                done[(ms, w)] = bench.run(row, ms, w, epochs=1, resume=False)
        out["workers"] += [done[(0.0, w)] for w in SCALING_WORKERS]
        out["latency"] += [done[(ms, workers)] for ms in SCALING_LATENCY_MS]
    return out


def curve_points(results: list[dict], x: str) -> dict[str, list[tuple[float, float]]]:
    """``row -> [(x, epoch-1 images/s)]`` for the rows that ran (pure)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if "error" in r or not r.get("epoch1"):
            continue
        curves.setdefault(r["row"], []).append((r[x], r["epoch1"]["rate"]))
    return {row: sorted(points) for row, points in curves.items()}


def _rate_cell(rate: float | None) -> str:
    """A point whose run failed says so (its traceback is in peers-last-run.log)."""
    return "failed" if rate is None else f"{rate:.0f}"


def scaling_table(scaling: dict[str, list[dict]]) -> str:
    """Epoch 1 images/s of each row at each point of both curves, one line a row (pure)."""
    lines = []
    for key, x, unit in (("workers", "workers", " workers"), ("latency", "latency_ms", " ms")):
        curves = curve_points(scaling.get(key, []), x)
        if not curves:
            continue
        xs = sorted({point[0] for points in curves.values() for point in points})
        head = [f"epoch 1 img/s by {key}", *(f"{v:g}{unit}" for v in xs)]
        body = [
            [LABELS.get(row, row), *(_rate_cell(dict(points).get(v)) for v in xs)]
            for row, points in curves.items()
        ]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        for line in [head, *body]:
            cells = [line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:]))]
            lines.append("  ".join(cells))
        lines.append("")
    return "\n".join(lines).rstrip()


# -- plots ---------------------------------------------------------------------------------


def plot(directory: str, profiles: dict[str, list[dict]], scaling: dict | None) -> list[str]:
    """PNG charts of the run: epochs per profile, and the scaling curves if measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []
    for name, results in profiles.items():
        ok = [r for r in results if "error" not in r]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.4
        xs = range(len(ok))
        ax.bar([x - width / 2 for x in xs], [r["epoch1"]["rate"] for r in ok], width,
               label="epoch 1 (cold)")  # fmt: skip
        ax.bar([x + width / 2 for x in xs], [r.get("epoch2", {}).get("rate", 0) for r in ok],
               width, label="epoch 2")  # fmt: skip
        ax.set_xticks(list(xs), [PLOT_LABELS[r["row"]] for r in ok], fontsize=8)
        ax.set_ylabel("images/s")
        ax.set_title(f"JPEG loaders over S3 ({name})")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(directory, f"peers-{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    axes = (
        ("workers", "workers", "DataLoader workers"),
        ("latency", "latency_ms", "added latency per request (ms)"),
    )
    for key, x, xlabel in axes:
        if not scaling or not scaling.get(key):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for row, points in curve_points(scaling[key], x).items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=LABELS[row])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("epoch 1 images/s")
        ax.set_title(f"epoch 1 against {key}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, f"peers-scaling-{key}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# -- the run -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="make the peers' venv and exit")
    parser.add_argument(
        "--venv", default=DEFAULT_VENV, help=f"peers' venv (default {DEFAULT_VENV})"
    )
    parser.add_argument(
        "--torch-index",
        default=None,
        help="--setup: an extra index with the CPU torch (if pip cannot find it)",
    )
    parser.add_argument("--quick", action="store_true", help="256 files: a few minutes")
    parser.add_argument("--files", type=int, default=None, help="default 3200 (256 quick)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--profile", choices=("loopback", "far", "both"), default="both")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset")
    parser.add_argument(
        "--resume-every-profile",
        action="store_true",
        help="measure the resume columns in each profile (default: the first one only)",
    )
    parser.add_argument("--scaling", action="store_true", help="also the scaling curves")
    parser.add_argument(
        "--scaling-rows", default=None, help="default: stock, unbroken, the main run's best peer"
    )
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument(
        "--bench-dir",
        default=os.environ.get("UNBROKEN_BENCH_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "unbroken", "bench"),
        help="where the generated JPEGs are kept between runs",
    )
    args = parser.parse_args(argv)
    args.files = args.files or (256 if args.quick else 3200)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    whole = 4 * args.batch_size
    if args.files % whole:
        parser.error(
            f"--files {args.files}: use a multiple of 4 x batch size ({whole}), so that "
            "each half of an epoch fills whole batches at world size 1 and 2 (else the "
            "batches drop_last leaves out would count as missing after a resume)"
        )
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.setup:
        setup_venv(args.venv, str(ROOT), args.torch_index)
        return
    os.makedirs(args.bench_dir, exist_ok=True)
    started = time.perf_counter()
    bench = Bench(args)
    try:
        profiles = run_profiles(bench, args)
        scaling = None
        if args.scaling:
            first = next(iter(profiles.values()))
            rows = (
                args.scaling_rows.split(",") if args.scaling_rows
                else [r for r in ("stock", "unbroken", best_peer(first)) if r]
            )  # fmt: skip
            if args.files < SCALING_MIN_BATCHES * args.batch_size:
                print(
                    f"warning: {args.files} files make {args.files // args.batch_size} batches; "
                    f"the scaling curves need {SCALING_MIN_BATCHES} or more for a steady rate "
                    "(at 4 workers the first 8 come at once): noise, not a curve",
                    file=sys.stderr,
                )
            scaling = run_scaling(bench, rows, args.workers)
    finally:
        bench.close()
    load = os.getloadavg()
    print(
        f"{args.files} JPEGs (mean {bench.mean_bytes / 1024:.0f} KB) on SeaweedFS S3, "
        f"decode = PIL + random crop + flip, batch {args.batch_size}, {args.workers} workers; "
        f"resume: saved at half an epoch, resumed at {1 if args.workers > 1 else 2} worker(s) "
        f"and at world size 2; load average {load[0]:.1f} / {load[1]:.1f} on "
        f"{os.cpu_count()} cores"
    )
    if len(profiles) > 1 and not args.resume_every_profile:
        print(f"resume columns measured in the {next(iter(profiles))} profile only")
    for name, results in profiles.items():
        print(f"\n== {name} ==")
        print(table(results))
    summary: dict[str, Any] = {
        "files": args.files,
        "mean_bytes": round(bench.mean_bytes),
        "workers": args.workers,
        "batch_size": args.batch_size,
        "load_average": [round(x, 2) for x in load],
        "seconds": round(time.perf_counter() - started, 1),
        "profiles": profiles,
        "unbroken_over": {name: ratios(results) for name, results in profiles.items()},
    }
    if scaling:
        summary["scaling"] = scaling
        print("\n== scaling (loopback; latency added by the delay line) ==")
        print(scaling_table(scaling))
    if args.plot:
        summary["plots"] = plot(args.plot, profiles, scaling)
        print("plots: " + ", ".join(summary["plots"]))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
