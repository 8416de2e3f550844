"""bench/data/epochs.py's table: the compared columns by default, every one with --all-columns."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("PIL")

import bench.data.epochs as data


def _epoch(images: int, rate: float, cpu_ms: float) -> data.Epoch:
    epoch = object.__new__(data.Epoch)  # the figures of a pass, without running one
    epoch.images, epoch.seconds, epoch.first_batch = images, images / rate + 1.0, 1.0
    epoch.rate, epoch.cpu_ms = rate, cpu_ms
    return epoch


def test_default_table_shows_rate_ratio_and_cpu_and_all_columns_the_rest():
    rows = {
        "stock remote": _epoch(576, 50.0, 3.0),
        "unbroken e1": _epoch(576, 400.0, 2.5),
        "unbroken e2": _epoch(576, 800.0, 2.0),
        "stock local": _epoch(576, 850.0, 1.9),
    }
    labels = {k: k for k in rows}
    short = data.table(rows, labels, {"unbroken e1": "57.2 -> 417 (7.3x)"}, False)
    full = data.table(rows, labels, {"unbroken e1": "57.2 -> 417 (7.3x)"}, True)
    head = short.splitlines()[0]
    assert all(title in head for title in data.MAIN_COLUMNS)
    assert "first batch s" not in head and "7.3x" not in short
    e1 = next(line for line in short.splitlines() if line.startswith("unbroken e1"))
    assert e1.split()[2:] == ["400.0", "8.0x", "2.50"]
    assert "first batch s" in full and "(7.3x)" in full and "576" in full


def _s3_epoch(rate: float, cpu_ms: float, server_ms: float, proxy_ms: float = 0.0) -> data.Epoch:
    epoch = _epoch(576, rate, cpu_ms)
    epoch.seconds = 576 / rate  # no start-up: busy is exactly rate x CPU
    epoch.outside_ms = {"server": server_ms, "proxy": proxy_ms}
    epoch.machine_busy = 0.5
    return epoch


def test_s3_table_has_a_row_per_loader_with_each_process_cpu_and_what_limited_it():
    rows = {
        "stock boto3": _s3_epoch(100.0, 4.0, 1.0),  # 0.5 cores of 2 busy: waits
        "unbroken e1": _s3_epoch(360.0, 3.0, 1.5, 0.5),  # 1.8 cores of 2: CPU-bound
        "unbroken e2": _s3_epoch(600.0, 2.0, 0.1),
        "stock local": _s3_epoch(650.0, 2.0, 0.0),
    }
    text = data.s3_table(rows, cores=2)
    head, *lines = text.splitlines()
    assert all(title in head for title in data.S3_COLUMNS)
    cells = {c[0]: c[1:] for c in (re.split(r"\s{2,}", line) for line in lines)}
    assert list(cells) == [data.S3_LABELS[name] for name in data.S3_ROW_ORDER]
    e1 = cells[data.S3_LABELS["unbroken e1"]]
    assert e1[:5] == ["360.0", "3.60x", "3.00", "1.50", "0.50"]
    assert e1[5] == "CPU 90% (client 60%, server 30%, proxy 10%)"
    assert cells[data.S3_LABELS["stock boto3"]][-1] == "waits on the remote (cores 25% busy)"
    rows["stock boto3"].machine_busy = 0.95  # the rest of the machine was taken by others
    assert data.limited_by(rows["stock boto3"], 2) == "CPU, other jobs took 70% (this row 25%)"

    ratios = data.s3_targets(rows)
    assert round(ratios["cold_vs_stock_boto3"], 3) == 3.6
    assert round(ratios["cold_vs_stock_boto3_by_cpu"], 3) == 1.0  # 5 / 5 ms per image
    line = data.s3_targets_line("loopback", ratios)
    assert "cold / stock boto3 = 3.60 (>= 2: MET)" in line
    assert "warm / local disk = 0.92 (>= 0.9: MET)" in line
    figures = data.s3_figures(rows)
    assert figures["unbroken_e1_images_per_s"] == 360.0
    assert figures["unbroken_e1_server_cpu_ms_per_image"] == 1.5
    assert figures["stock_boto3_proxy_cpu_ms_per_image"] == 0.0


def test_profile_defaults_loopback_when_quick_and_both_otherwise():
    assert data.parse_args(["--s3", "--quick"]).profile is None  # s3_main picks loopback
    assert data.parse_args(["--s3", "--profile", "far"]).profile == "far"
    with pytest.raises(SystemExit):
        data.parse_args(["--s3", "--profile", "nowhere"])


@pytest.mark.slow
@pytest.mark.s3
def test_a_tiny_s3_run_prints_each_profile_and_the_json(tmp_path):
    import json

    from .scripts import run_bench_script

    out, _ = run_bench_script(
        "bench.data.epochs", "--s3", "--quick", "--profile", "both", "--files", "96",
        "--batch-size", "8", "--bench-dir", str(tmp_path), timeout=600,
    )  # fmt: skip
    summary = json.loads(out.strip().splitlines()[-1])
    for profile in ("loopback", "far"):
        assert f"[{profile}]" in out and f"targets ({profile})" in out
        assert summary[profile]["unbroken_e1_images_per_s"] > 0
        assert summary[profile]["stock_boto3_server_cpu_ms_per_image"] > 0
    assert summary["far"]["stock_boto3_proxy_cpu_ms_per_image"] > 0


def test_an_epoch_splits_its_cpu_between_this_process_and_its_children():
    """``own_ms`` is this process's share of ``cpu_ms``: a child's spin counts only in the
    whole, this process's spin in both."""
    import subprocess
    import sys
    import time

    from bench.common.jpeg_workload import Epoch

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"

    def batches():
        subprocess.run([sys.executable, "-c", spin], check=True)  # a worker's CPU
        yield [0]
        started = time.process_time()
        while time.process_time() - started < 0.3:  # the training process's own
            pass
        yield [1]

    epoch = Epoch(batches())
    assert epoch.images == 2
    assert 0.3 * 1000 / 2 <= epoch.own_ms < epoch.cpu_ms
    assert epoch.cpu_ms - epoch.own_ms >= 0.3 * 1000 / 2 * 0.9
