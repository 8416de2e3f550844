"""A tiny real run of bench/peers/loaders.py: stock and unbroken rows (no peers venv needed)."""

from __future__ import annotations

import json

import pytest

from .scripts import run_bench_script


@pytest.mark.slow
def test_quick_run_prints_table_and_json_with_measured_resume(tmp_path):
    stdout, _ = run_bench_script(
        "bench.peers.loaders", "--files", "128", "--rows", "stock,unbroken",
        "--profile", "loopback", "--bench-dir", str(tmp_path), timeout=600,
    )  # fmt: skip
    summary = json.loads(stdout.strip().splitlines()[-1])
    rows = {r["row"]: r for r in summary["profiles"]["loopback"]}
    assert "error" not in rows["stock"] and "error" not in rows["unbroken"]
    for row in rows.values():
        assert row["epoch_check"]["delivered"] == 128 and row["epoch_check"]["mismatched"] == 0
    assert rows["stock"]["resume_workers"] == "no state"
    for column in ("resume_workers", "resume_world"):
        got = rows["unbroken"][column]
        assert got["duplicates"] == 0 and got["missing"] == 0 and got["mismatched"] == 0
    assert "stock DataLoader + boto3" in stdout and "resume workers" in stdout
