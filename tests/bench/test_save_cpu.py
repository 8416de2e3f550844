"""bench.checkpoint.save_cpu end to end (quick): every row saves, every figure is a real number."""

from __future__ import annotations

import importlib.util
import json

import pytest

import bench.checkpoint.save_cpu as save_cpu


def test_quick_run_reports_cpu_per_gib_for_every_row(capsys, tmp_path):
    assert save_cpu.main(["--quick", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    rows = ("memcpy_floor", "torch_save", "dcp_save", "unbroken")
    for row in rows:
        assert summary[f"{row}_cpu_s_per_gib"] >= 0.0  # machine-wide: clock-tick grained
        assert summary[f"{row}_process_cpu_s_per_gib"] > 0.0
    # The floor copies every byte once; a save copies, checksums and writes them too.
    floor = summary["memcpy_floor_process_cpu_s_per_gib"]
    assert summary["unbroken_process_cpu_s_per_gib"] > floor
    assert list(tmp_path.iterdir()) == []  # its files (and the remote's) are removed
    assert "CPU s per GiB" in out and "x memcpy floor" in out and "user s/GiB" not in out


def test_all_columns_adds_the_process_cpu_split():
    results = {
        "memcpy floor": {"user": 0.1, "system": 0.05, "machine": 0.2, "wall": 0.1},
        "unbroken": {"user": 0.3, "system": 0.2, "machine": 0.5, "wall": 0.4},
    }
    short, full = save_cpu.table(results), save_cpu.table(results, all_columns=True)
    assert "2.5x" in short.splitlines()[2]  # 0.5 / 0.2 of the floor's machine CPU
    assert "user s/GiB" not in short and "user s/GiB" in full and "0.300" in full


def test_state_is_about_the_size_asked_for():
    state = save_cpu.make_state(0.25)
    assert save_cpu.state_bytes(state) == pytest.approx(0.25 * save_cpu.GiB, rel=0.01)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        save_cpu.main(["--gib", "0"])


def test_s3_quick_run_splits_off_the_servers_cpu(capsys, tmp_path):
    """Against the real S3 server: the raw put and both unbroken rows save, the server's
    CPU is measured (it stores every byte, so it is never zero), and only the row with
    the save helper has a helper's CPU."""
    assert save_cpu.main(["--s3", "--quick", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    rows = ["raw_put", "unbroken", "unbroken_threads", "unbroken_disk"]
    if importlib.util.find_spec("s3torchconnector") is not None:  # the bench extra
        rows.append("dcp_s3connector")
    for row in rows:
        assert summary[f"{row}_server_cpu_s_per_gib"] > 0.0, row
    assert "of it: server" in out and "SeaweedFS" in out
    lines = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert float(lines["unbroken"][-1]) > 0.0  # the helper uploaded
    assert float(lines["unbroken threads"][-1]) == 0.0
    assert float(lines["unbroken disk"][-1]) == 0.0  # no helper on the disk tier
    assert list(tmp_path.iterdir()) == []
