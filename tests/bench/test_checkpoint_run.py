"""bench/checkpoint/saves.py end to end: real gloo ranks, real DCP, the emulated remote."""

from __future__ import annotations

import json
import os

import pytest

from bench.checkpoint.measure import COLUMNS, shown_columns

from .scripts import run_bench_script


def run_bench(*args: str, timeout: float) -> tuple[str, str]:
    return run_bench_script("bench.checkpoint.saves", *args, timeout=timeout)


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("row "))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith("  "):
            break
        cells = line.split("  ")
        rows[cells[0].strip()] = [c.strip() for c in cells[1:] if c.strip()]
    return rows


@pytest.mark.multiprocess
def test_quick_floor_row(tmp_path):
    (tmp_path / "r").mkdir()
    stdout, _ = run_bench(
        "--quick",
        "--baseline-twice",
        "--all-columns",
        "--rows",
        "floor,floor_2tier",
        "--saves",
        "2",
        "--work-dir",
        str(tmp_path / "w"),
        "--remote-dir",
        str(tmp_path / "r"),
        timeout=240,
    )
    rows = table_rows(stdout)
    assert set(rows) == {
        "no saves",
        "floor (memcpy)",
        "floor + 2 disk writes",
        "no saves (again)",
    }
    assert "no-saves runs differ by" in stdout  # the noise between the two baselines
    floor = rows["floor (memcpy)"]
    cell = dict(zip([c.key for c in COLUMNS], floor))
    assert len(floor) == len(COLUMNS)
    assert cell["blocked_s"] != "n/a" and cell["restore_local_s"] != "n/a"
    assert cell["extra_cpu_s"] != "n/a" and cell["off_main_cpu_s"] != "n/a"
    assert cell["restore_durable_s"] == "n/a"  # a memcpy has no durable tier
    two_tier = dict(zip([c.key for c in COLUMNS], rows["floor + 2 disk writes"]))
    assert two_tier["blocked_s"] != "n/a" and two_tier["commit_s"] != "n/a"
    assert two_tier["restore_local_s"] == two_tier["restore_durable_s"] == "n/a"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["quick"] is True and result["saves"] == 2 and result["targets_total"] == 6
    assert not (tmp_path / "w").exists()  # scratch removed without --keep
    assert str(tmp_path / "r") in stdout and os.listdir(tmp_path / "r") == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_all_rows(tmp_path):
    stdout, _ = run_bench(
        "--quick", "--all-columns", "--work-dir", str(tmp_path / "w"), timeout=600
    )
    rows = table_rows(stdout)
    for name in ("torch.save rank 0", "dcp.save", "dcp.async_save default", "dcp.async_save best"):
        cells = rows[name]
        assert cells[0] != "n/a" and cells[2] != "n/a" and cells[6] != "n/a", (name, stdout)
    assert "unbroken" in rows
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["targets_total"] == 6


@pytest.mark.multiprocess
def test_a_row_that_overruns_is_na_and_the_run_still_reports(tmp_path):
    stdout, _ = run_bench(
        "--quick",
        "--baseline-twice",
        "--isolate",
        "--rows",
        "floor",
        "--row-timeout",
        "0.5",
        "--work-dir",
        str(tmp_path / "w"),
        timeout=240,
    )
    rows = table_rows(stdout)
    assert set(rows) == {"no saves", "floor (memcpy)", "no saves (again)"}
    assert all(cells == ["n/a"] * len(shown_columns()) for cells in rows.values()), stdout
    assert "time lost s/save" in stdout and "background CPU s/save" not in stdout
    assert stdout.count("timed out after") == 3
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["targets_met"] == 0 and last["unbroken_error"] is None
