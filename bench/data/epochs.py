"""Images/s of a JPEG training pipeline on the standard emulated remote, side by side.

Rows, all with the same worker count, batch size and decode (PIL decode, random
224x224 crop, random horizontal flip):
  stock remote   torch.utils.data.DataLoader over a plain map-style Dataset whose
                 __getitem__ calls ``store.read_bytes(key)`` on the emulated remote
                 (the same network every row pays: 20 ms per request, 200 MB/s link)
  unbroken e1    unbroken.VolumeDataset + unbroken.DataLoader on the same remote, cold cache
  unbroken e2    the same loader's second epoch: served from the local cache
  stock local    torch DataLoader reading the same files from local disk: the ceiling

    python -m bench.data.epochs [--quick] [--files 10000] [--workers N] [--batch-size 32]

With ``--s3`` the same decode runs against a real S3 server (SeaweedFS on loopback, see
bench/common/s3remote.py), per remote profile (``--profile loopback|far|both``):
  stock boto3    torch DataLoader over a map-style Dataset calling boto3 ``get_object``
                 per item, one client per worker process made after the fork
  unbroken e1    ub.VolumeDataset("s3://...") + ub.DataLoader, cold cache
  unbroken e2    its second epoch, from the local cache
  stock local    the stock DataLoader from local disk: the ceiling

    python -m bench.data.epochs --s3 [--quick] [--profile both] [--files 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.utils.data

import unbroken as ub
from bench.common.jpeg_workload import CROP, Epoch, decode, ensure_dataset
from unbroken._util.sizes import format_size
from unbroken.storage.link import discard_link

PUBLISHED = {"epoch1": (57.2, 417.0), "epoch2": (371.6, 6590.0)}
"""Published (stock remote, theirs) images/s: epoch 1 is 7.3x, epoch 2 is 17.7x."""


# -- stock baselines -----------------------------------------------------------------------


class RemoteFiles(torch.utils.data.Dataset):
    """What a user writes without unbroken: read each file from the remote, decode it."""

    def __init__(self, url: str, options: dict, keys: list[str]) -> None:
        self.url, self.options, self.keys = url, options, keys
        self._store: tuple[int, ub.Store] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._store is None or self._store[0] != os.getpid():  # one client per worker
            self._store = (os.getpid(), ub.open_store(self.url, **self.options))
        return decode(self._store[1].read_bytes(self.keys[i]), self.keys[i])


class LocalFiles(torch.utils.data.Dataset):
    def __init__(self, root: str, keys: list[str]) -> None:
        self.root, self.keys = root, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(os.path.join(self.root, self.keys[i]), "rb") as f:
            return decode(f.read(), self.keys[i])


def stock_loader(dataset, args) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        drop_last=True,
    )  # fmt: skip


def unbroken_epochs(
    remote_url: str, options: dict, args, run_dir: str, outside: dict | None = None
) -> tuple[Epoch, Epoch, dict, dict]:
    """Epoch 1 with an empty cache, then epoch 2 of the same loader; metrics after each.

    The cache stays in ``run_dir`` until the whole run ends: on ext4 without a journal,
    deleting 10,000 files makes every file created in the next minutes slower (each new
    inode skips the recently freed ones), which would tax the next round's cold epoch
    for the previous round's clean-up, something a training job never pays.
    """
    ds = ub.VolumeDataset(
        remote_url, decode, cache_dir=os.path.join(run_dir, "cache"),
        storage_options=options, index_dir=os.path.join(run_dir, "index"),
        include="*.jpg", seed=0,
    )  # fmt: skip
    loader = ub.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    e1 = Epoch(loader, outside)
    cold = loader.metrics.snapshot()
    e2 = Epoch(loader, outside)
    warm = loader.metrics.snapshot()
    del loader
    return e1, e2, cold, warm


# -- the report --------------------------------------------------------------------------

ROW_ORDER = ("stock remote", "unbroken e1", "unbroken e2", "stock local")
MAIN_COLUMNS = ("images/s", "x stock remote", "CPU ms per image")
"""What a user compares; ``--all-columns`` adds the rest."""


def table(
    rows: dict[str, Epoch], labels: dict[str, str], published: dict[str, str], all_columns: bool
) -> str:
    """The rows side by side: the compared columns, or every one."""
    stock = rows["stock remote"].rate
    cells: dict[str, list[str]] = {}
    for name in ROW_ORDER:
        r = rows[name]
        cells[name] = [
            f"{r.images}",
            f"{r.seconds:.2f}",
            f"{r.first_batch:.2f}",
            f"{r.rate:.1f}",
            f"{r.rate / stock:.1f}x",
            f"{r.cpu_ms:.2f}",
            published.get(name, ""),
        ]
    titles = ["images", "epoch s", "first batch s", *MAIN_COLUMNS, "published: stock -> theirs"]
    keep = [i for i, t in enumerate(titles) if all_columns or t in MAIN_COLUMNS]
    lines = [["run", *(titles[i] for i in keep)]]
    lines += [[labels[n], *(cells[n][i] for i in keep)] for n in ROW_ORDER]
    return _aligned(lines)


def _aligned(lines: list[list[str]]) -> str:
    """Rows of cells as text: the first column to the left, the others to the right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join([line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:]))])
        for line in lines
    )


# -- the run -----------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.s3:
        s3_main(args)
    else:
        emulated_main(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 files: under a minute")
    parser.add_argument("--files", type=int, default=None, help="default 10000 (600 quick)")
    parser.add_argument("--workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--repeat", type=int, default=None, help="rounds, best of each row (1 quick, 2 full)"
    )
    parser.add_argument(
        "--all-columns",
        action="store_true",
        help="also print images, epoch and first-batch seconds, published figures, cache",
    )
    parser.add_argument(
        "--bench-dir",
        default=os.environ.get("UNBROKEN_BENCH_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "unbroken", "bench"),
        help="where the generated JPEGs are kept between runs",
    )
    parser.add_argument(
        "--s3", action="store_true", help="against a real S3 server (SeaweedFS on loopback)"
    )
    parser.add_argument(
        "--profile",
        choices=("loopback", "far", "both"),
        default=None,
        help="with --s3: the remote profile(s); default both (loopback with --quick)",
    )
    return parser.parse_args(argv)


def emulated_main(args: argparse.Namespace) -> None:
    """The rows on the standard emulated remote."""
    files = args.files or (600 if args.quick else 10_000)
    args.workers = args.workers or _cores()
    args.repeat = max(1, args.repeat or (1 if args.quick else 2))
    profile = ub.RemoteProfile(link=f"bench-data-{os.getpid()}")
    options = profile.as_options()

    root, keys = ensure_dataset(args.bench_dir, files, args.workers)
    total_bytes = sum(os.path.getsize(os.path.join(root, k)) for k in keys)
    mean = total_bytes / files
    remote_url = f"emulated::{root}"
    rows: dict[str, Epoch] = {}

    def keep_best(name: str, epoch: Epoch) -> None:
        if name not in rows or epoch.rate > rows[name].rate:
            rows[name] = epoch

    # rows interleaved round by round, best of --repeat: load drift hits every row alike
    runs_dir = tempfile.mkdtemp(prefix="unbroken-bench-data-", dir=args.bench_dir)
    try:
        from tqdm import tqdm

        for round_ in tqdm(range(args.repeat), desc="rounds", unit="round", file=sys.stderr):
            keep_best("stock local", Epoch(stock_loader(LocalFiles(root, keys), args)))
            remote = RemoteFiles(remote_url, options, keys)
            keep_best("stock remote", Epoch(stock_loader(remote, args)))
            run_dir = os.path.join(runs_dir, f"round{round_}")
            e1, e2, cold, warm = unbroken_epochs(remote_url, options, args, run_dir)
            if "unbroken e1" not in rows or e1.rate > rows["unbroken e1"].rate:
                cache_e1, cache_e2 = cold, warm
            keep_best("unbroken e1", e1)
            keep_best("unbroken e2", e2)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
        discard_link(profile.link)
    cold, warm = cache_e1, cache_e2

    ips = {name: epoch.rate for name, epoch in rows.items()}
    cores = _cores()
    link_ips = profile.bandwidth / mean
    decode_ips = cores * 1000 / rows["stock local"].cpu_ms  # cores / CPU cost of an image
    binding = min(link_ips, decode_ips)
    bound_by = "link" if link_ips < decode_ips else "decode"
    stock = ips["stock remote"]
    labels = {
        "stock remote": "stock DataLoader, remote",
        "unbroken e1": "unbroken epoch 1 (cold)",
        "unbroken e2": "unbroken epoch 2 (warm)",
        "stock local": "stock DataLoader, local disk",
    }
    published = {
        "unbroken e1": "57.2 -> 417 (7.3x)",
        "unbroken e2": "371.6 -> 6590 (17.7x)",
    }
    print(f"remote: {profile.describe()}; {files} JPEGs, mean {format_size(mean)}")
    print(
        f"{args.workers} workers everywhere, batch {args.batch_size}, decode = PIL + random "
        f"{CROP} crop + flip; stock remote reads with store.read_bytes in a plain Dataset; "
        f"best of {args.repeat} round(s); load average {os.getloadavg()[0]:.1f} on {cores} cores"
    )
    print(table(rows, labels, published, args.all_columns))
    e1_ratio = ips["unbroken e1"] / binding
    e2_ratio = ips["unbroken e2"] / ips["stock local"]
    e1_idle = min(link_ips, cores * 1000 / rows["unbroken e1"].cpu_ms)
    e1_cpu_ratio = e1_idle / binding
    e2_cpu_ratio = rows["stock local"].cpu_ms / rows["unbroken e2"].cpu_ms
    print(
        f"limits: link {link_ips:.0f} images/s; decode {decode_ips:.0f} images/s "
        f"({cores} cores / {rows['stock local'].cpu_ms:.2f} CPU ms per image); binding: {bound_by}"
    )
    print(f"targets, measured: epoch 1 / binding limit = {e1_ratio:.2f} (>= 0.8); "
          f"epoch 2 / local ceiling = {e2_ratio:.2f} (>= 0.9)")  # fmt: skip
    print(f"targets, from CPU cost (what idle cores would give): epoch 1 = {e1_cpu_ratio:.2f}; "
          f"epoch 2 = {e2_cpu_ratio:.2f}")  # fmt: skip
    e1_cache = {k: cold.get(k, 0) for k in ("hits", "misses", "bytes_fetched", "retries")}
    waits = (cold["fetch_seconds"], warm["fetch_seconds"] - cold["fetch_seconds"])
    if args.all_columns:
        print(f"unbroken cache, epoch 1: {e1_cache}; "
              f"blocked in next(): {waits[0]:.2f} s (e1), {waits[1]:.2f} s (e2)")  # fmt: skip
    else:
        print("(--all-columns: images, epoch and first-batch seconds, published ratios, cache)")
    summary = {
        "files": files,
        "mean_bytes": round(mean),
        "workers": args.workers,
        "batch_size": args.batch_size,
        **{f"{k.replace(' ', '_')}_images_per_s": round(v, 1) for k, v in ips.items()},
        **{f"{k.replace(' ', '_')}_cpu_ms_per_image": round(r.cpu_ms, 3) for k, r in rows.items()},
        "link_images_per_s": round(link_ips, 1),
        "decode_images_per_s": round(decode_ips, 1),
        "bound_by": bound_by,
        "epoch1_vs_binding_limit": round(e1_ratio, 3),
        "epoch2_vs_local_ceiling": round(e2_ratio, 3),
        "epoch1_vs_binding_limit_by_cpu": round(e1_cpu_ratio, 3),
        "epoch2_vs_local_ceiling_by_cpu": round(e2_cpu_ratio, 3),
        "load_average": round(os.getloadavg()[0], 2),
        "epoch1_vs_stock_remote": round(ips["unbroken e1"] / stock, 2),
        "epoch2_vs_stock_remote": round(ips["unbroken e2"] / stock, 2),
        "published_epoch1_vs_stock": round(PUBLISHED["epoch1"][1] / PUBLISHED["epoch1"][0], 1),
        "published_epoch2_vs_stock": round(PUBLISHED["epoch2"][1] / PUBLISHED["epoch2"][0], 1),
        "epoch1_misses": cold.get("misses", 0),
        "epoch2_misses": warm.get("misses", 0) - cold.get("misses", 0),
    }
    print(json.dumps(summary))


# -- the real S3 server (--s3) -------------------------------------------------------------


class Boto3Files(torch.utils.data.Dataset):
    """What a user writes for S3 without unbroken: boto3 ``get_object`` per item, one
    client per worker process, made after the fork (a boto3 client is not fork-safe)."""

    def __init__(self, remote, bucket: str, prefix: str, keys: list[str]) -> None:
        self.remote, self.bucket, self.prefix, self.keys = remote, bucket, prefix, keys
        self._client: tuple[int, object] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._client is None or self._client[0] != os.getpid():
            self._client = (os.getpid(), self.remote.client())
        got = self._client[1].get_object(Bucket=self.bucket, Key=f"{self.prefix}/{self.keys[i]}")
        return decode(got["Body"].read(), self.keys[i])


S3_ROW_ORDER = ("stock boto3", "unbroken e1", "unbroken e2", "stock local")
S3_LABELS = {
    "stock boto3": "stock DataLoader + boto3",
    "unbroken e1": "unbroken epoch 1 (cold)",
    "unbroken e2": "unbroken epoch 2 (warm)",
    "stock local": "stock DataLoader, local disk",
}
S3_COLUMNS = (
    "images/s", "x stock boto3", "loader CPU ms/img", "server CPU ms/img", "proxy CPU ms/img",
    "limited by",
)  # fmt: skip
CPU_BOUND = 0.8
"""A row that kept this share of the machine's cores busy is limited by CPU."""
MACHINE_BUSY = 0.9
"""A row below CPU_BOUND whose machine was this busy (every job) was starved by others."""


def limited_by(epoch: Epoch, cores: int) -> str:
    """What held a row back: CPU (whose), CPU taken by other jobs, or waiting on the remote.

    Busy is every process of the row (loader, server, proxy) over the whole epoch, start-up
    included, in cores; the machine's share (every job's) tells a row starved by others
    from one that waits on the remote.
    """
    shares = {"client": epoch.cpu_ms, **epoch.outside_ms}
    total_ms = sum(shares.values())
    busy = total_ms * epoch.images / 1000 / max(epoch.seconds, 1e-9) / cores
    if busy >= CPU_BOUND:
        split = ", ".join(
            f"{k} {v / total_ms:.0%}" for k, v in shares.items() if v >= 0.05 * total_ms
        )
        return f"CPU {busy:.0%} ({split})"
    machine = getattr(epoch, "machine_busy", None)
    if machine is not None and machine >= MACHINE_BUSY:
        return f"CPU, other jobs took {max(machine - busy, 0):.0%} (this row {busy:.0%})"
    return f"waits on the remote (cores {busy:.0%} busy)"


def s3_table(rows: dict[str, Epoch], cores: int) -> str:
    """One profile's rows side by side; the ratio is over the stock boto3 row."""
    stock = rows["stock boto3"].rate
    lines = [["run", *S3_COLUMNS]]
    for name in S3_ROW_ORDER:
        r = rows[name]
        lines.append([
            S3_LABELS[name], f"{r.rate:.1f}", f"{r.rate / stock:.2f}x", f"{r.cpu_ms:.2f}",
            f"{r.outside_ms.get('server', 0.0):.2f}", f"{r.outside_ms.get('proxy', 0.0):.2f}",
            limited_by(r, cores),
        ])  # fmt: skip
    return _aligned(lines)


def s3_targets(rows: dict[str, Epoch]) -> dict[str, float]:
    """The targets' ratios, measured and from CPU per image (what idle cores would give)."""

    def total(r: Epoch) -> float:
        return r.cpu_ms + sum(r.outside_ms.values())

    return {
        "cold_vs_stock_boto3": rows["unbroken e1"].rate / rows["stock boto3"].rate,
        "warm_vs_local_disk": rows["unbroken e2"].rate / rows["stock local"].rate,
        "cold_vs_stock_boto3_by_cpu": total(rows["stock boto3"]) / total(rows["unbroken e1"]),
        "warm_vs_local_disk_by_cpu": total(rows["stock local"]) / total(rows["unbroken e2"]),
    }


def s3_targets_line(profile: str, ratios: dict[str, float]) -> str:
    def met(value: float, goal: float) -> str:
        return f"{value:.2f} (>= {goal:g}: {'MET' if value >= goal else 'NOT MET'})"

    return (
        f"targets ({profile}): cold / stock boto3 = {met(ratios['cold_vs_stock_boto3'], 2)}; "
        f"warm / local disk = {met(ratios['warm_vs_local_disk'], 0.9)}; from CPU per image: "
        f"{ratios['cold_vs_stock_boto3_by_cpu']:.2f} and {ratios['warm_vs_local_disk_by_cpu']:.2f}"
    )


def s3_figures(rows: dict[str, Epoch]) -> dict[str, float]:
    """One profile's rows for the JSON line: rate and CPU per image of each process."""
    figures: dict[str, float] = {}
    for name, r in rows.items():
        row = name.replace(" ", "_")
        figures[f"{row}_images_per_s"] = round(r.rate, 1)
        figures[f"{row}_cpu_ms_per_image"] = round(r.cpu_ms, 3)
        for who, ms in r.outside_ms.items():
            figures[f"{row}_{who}_cpu_ms_per_image"] = round(ms, 3)
    return figures


def s3_main(args: argparse.Namespace) -> None:
    """Every profile's rows against one SeaweedFS server, interleaved round by round."""
    from tqdm import tqdm

    from bench.common.jpeg_workload import upload
    from bench.common.s3remote import S3Remote

    files = args.files or (600 if args.quick else 3000)
    args.workers = args.workers or _cores()
    args.repeat = max(1, args.repeat or (1 if args.quick else 2))
    chosen = args.profile or ("loopback" if args.quick else "both")
    profiles = ["loopback", "far"] if chosen == "both" else [chosen]
    root, keys = ensure_dataset(args.bench_dir, files, args.workers)
    mean = sum(os.path.getsize(os.path.join(root, k)) for k in keys) / files
    cores = _cores()
    loopback = S3Remote()
    remotes = {p: loopback if p == "loopback" else S3Remote.profile(p, loopback.server)
               for p in profiles}  # fmt: skip
    rows: dict[str, dict[str, Epoch]] = {p: {} for p in profiles}

    def keep_best(profile: str, name: str, epoch: Epoch) -> None:
        if name not in rows[profile] or epoch.rate > rows[profile][name].rate:
            rows[profile][name] = epoch

    runs_dir = tempfile.mkdtemp(prefix="unbroken-bench-data-s3-", dir=args.bench_dir)
    try:
        bucket, prefix = loopback.new_root().split("/", 1)
        upload(loopback.client(), bucket, prefix, root, keys)
        url = f"s3://{bucket}/{prefix}"
        for round_ in tqdm(range(args.repeat), desc="rounds", unit="round", file=sys.stderr):
            local = Epoch(stock_loader(LocalFiles(root, keys), args))
            for p, remote in remotes.items():
                outside = {"server": remote.server_cpu_seconds, "proxy": remote.proxy_cpu_seconds}
                keep_best(p, "stock local", local)
                boto = Boto3Files(remote, bucket, prefix, keys)
                keep_best(p, "stock boto3", Epoch(stock_loader(boto, args), outside))
                run_dir = os.path.join(runs_dir, f"{p}-round{round_}")
                e1, e2, _, _ = unbroken_epochs(url, remote.storage_options, args, run_dir, outside)
                keep_best(p, "unbroken e1", e1)
                keep_best(p, "unbroken e2", e2)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
        for remote in remotes.values():
            remote.close()

    load = os.getloadavg()[0]
    print(f"{files} JPEGs, mean {format_size(mean)}; {args.workers} workers everywhere, batch "
          f"{args.batch_size}, decode = PIL + random {CROP} crop + flip; best of {args.repeat} "
          f"round(s); load average {load:.1f} on {cores} cores")  # fmt: skip
    print("CPU ms/img: loader = this process and its workers; server = SeaweedFS; proxy = "
          "the delay line (both left out of the loader's). limited by: CPU when the row "
          f"kept >= {CPU_BOUND:.0%} of the cores busy (whose share); other jobs when the "
          f"machine was >= {MACHINE_BUSY:.0%} busy; else waits on the remote")  # fmt: skip
    summary: dict = {"files": files, "mean_bytes": round(mean), "workers": args.workers,
                     "batch_size": args.batch_size, "load_average": round(load, 2)}  # fmt: skip
    for p in profiles:
        print(f"\n[{p}] {remotes[p].describe()}")
        print(s3_table(rows[p], cores))
        ratios = s3_targets(rows[p])
        print(s3_targets_line(p, ratios))
        summary[p] = {**s3_figures(rows[p]), **{k: round(v, 3) for k, v in ratios.items()}}
    print(json.dumps(summary))


def _cores() -> int:
    from unbroken.data.loader import default_num_workers

    return default_num_workers()


if __name__ == "__main__":
    main()
