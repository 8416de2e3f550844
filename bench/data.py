"""Images/s of a JPEG training pipeline on the standard emulated remote, side by side.

Rows, all with the same worker count, batch size and decode (PIL decode, random
224x224 crop, random horizontal flip):
  stock remote   torch.utils.data.DataLoader over a plain map-style Dataset whose
                 __getitem__ calls ``store.read_bytes(key)`` on the emulated remote
                 (the same network every row pays: 20 ms per request, 200 MB/s link)
  unbroken e1    unbroken.VolumeDataset + unbroken.DataLoader on the same remote, cold cache
  unbroken e2    the same loader's second epoch: served from the local cache
  stock local    torch DataLoader reading the same files from local disk: the ceiling

    python bench/data.py [--quick] [--files 10000] [--workers N] [--batch-size 32]
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
from _jpeg_workload import CROP, Epoch, decode, ensure_dataset
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
    remote_url: str, options: dict, args, run_dir: str
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
    e1 = Epoch(loader)
    cold = loader.metrics.snapshot()
    e2 = Epoch(loader)
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
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join([line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:]))])
        for line in lines
    )


# -- the run -----------------------------------------------------------------------------


def main() -> None:
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
    args = parser.parse_args()
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


def _cores() -> int:
    from unbroken.data.loader import default_num_workers

    return default_num_workers()


if __name__ == "__main__":
    main()
