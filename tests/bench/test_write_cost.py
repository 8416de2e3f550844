"""bench.checkpoint.write_cost: the arithmetic of its report, its memory kinds, and a quick run."""

from __future__ import annotations

import json

import pytest

from bench.checkpoint.write_cost import GiB, buffer, parse_args, report

from .scripts import run_bench_script


def test_report_charges_each_round_against_its_own_reference():
    # Round 1 ran 10 % slower throughout: the writers' loss is measured within rounds.
    results = {
        "none": [(100.0, 0, 0.0), (90.0, 0, 0.0)],
        "shared": [(80.0, 4 * GiB, 0.4), (72.0, 4 * GiB, 0.4)],
        "private_huge": [(95.0, 6 * GiB, 0.2), (85.5, 6 * GiB, 0.2)],
    }
    out = report(results, phase=10.0)
    last = json.loads(out.splitlines()[-1])
    # 20 % of 2 processes for 10 s over 4 GiB; 5 % of the same over 6 GiB.
    assert last["core_s_per_gib"]["shared"]["core_s_per_gib"] == pytest.approx(1.0)
    assert last["core_s_per_gib"]["shared"]["se"] == pytest.approx(0.0, abs=1e-9)
    assert last["core_s_per_gib"]["private_huge"]["core_s_per_gib"] == pytest.approx(
        1 / 6, abs=1e-4
    )
    assert last["core_s_per_gib"]["shared"]["writer_cpu_s_per_gib"] == pytest.approx(0.1)
    assert last["shared_over_private_huge"] == pytest.approx(6.0, rel=1e-3)
    assert last["rounds"] == 2


def test_every_kind_of_memory_is_what_it_says():
    shared, private = buffer("shared", 4 << 20), buffer("private_huge", 4 << 20)
    assert len(shared) == len(private) == 4 << 20
    with pytest.raises(ValueError, match="no kind of memory 'none'"):
        buffer("none", 4096)


@pytest.mark.parametrize("argv", [["--gib", "0"], ["--phase", "-1"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.slow  # the bench's own run (make bench)
@pytest.mark.multiprocess
def test_quick_run_reports_every_kind_of_memory(tmp_path):
    out, _ = run_bench_script(
        "bench.checkpoint.write_cost", "--quick", "--dir", str(tmp_path), timeout=120
    )
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last["core_s_per_gib"]) == {"shared", "private_4k", "private_huge"}
    assert last["rounds"] == 2
    assert "written through" in out
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_a_reference_phase_that_counted_nothing_is_refused():
    results = {"none": [(0.0, 0, 0.0)], "shared": [(10.0, GiB, 0.1)]}
    with pytest.raises(ValueError, match="phase without a writer counted no iterations"):
        report(results, phase=1.0)
