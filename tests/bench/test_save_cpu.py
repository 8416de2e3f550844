"""bench/save_cpu.py end to end (quick): every row saves, every figure is a real number."""

from __future__ import annotations

import json

import pytest

import save_cpu


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


def test_state_is_about_the_size_asked_for():
    state = save_cpu.make_state(0.25)
    assert save_cpu.state_bytes(state) == pytest.approx(0.25 * save_cpu.GiB, rel=0.01)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        save_cpu.main(["--gib", "0"])
