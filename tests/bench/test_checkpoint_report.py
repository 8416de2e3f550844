"""The pure parts of bench/checkpoint/saves.py: arithmetic of the report, the table, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.checkpoint.job import checksum, model_shape
from bench.checkpoint.measure import (
    COLUMNS,
    GiB,
    evaluate,
    excess_over_median,
    format_table,
    format_targets,
    in_row_extra,
    json_line,
    lasting_extra,
    shown_columns,
    split_steps,
)
from bench.checkpoint.saves import baseline_loop, parse_args, report

ENV = {
    "state_bytes": 2e9,
    "rank_bytes": 1 << 30,
    "bandwidth": 200e6,
    "latency": 0.02,
    "local_tier_bps": 2e9,
}


def test_excess_counts_only_flagged_steps_above_the_median():
    durations = [1.0, 1.2, 0.9, 3.0, 1.1, 1.0]
    flagged = [False, False, False, True, False, True]
    # median of unflagged (1.0, 1.2, 0.9, 1.1) is 1.05
    assert excess_over_median(durations, flagged) == pytest.approx(3.0 - 1.05)
    assert excess_over_median([2.0], [True]) == 0.0


def _ends(durations):
    out, t = [], 0.0
    for d in durations:
        t += d
        out.append(t)
    return out


def test_in_row_extra_measures_against_the_runs_own_quiet_steps():
    # every 4 steps; a save step costs 0.5 s more, the two steps after it 0.2 s each
    durations = [1.0, 1.0, 1.0, 1.5, 1.2, 1.2, 1.0, 1.5, 1.2, 1.2, 1.0]
    assert in_row_extra(_ends(durations), 4, settle_s=2.0) == pytest.approx(0.9)
    # the whole run 5% slower (the drift between rows run minutes apart): the same
    # cost in that run's own seconds, not 5% of the loop charged to the saves
    slower = [1.05 * d for d in durations]
    assert in_row_extra(_ends(slower), 4, settle_s=2.1) == pytest.approx(0.945)
    # a save window longer than the gap: only the steps before the first save are quiet
    assert in_row_extra(_ends(durations), 4, settle_s=60.0) == pytest.approx(0.9)
    # noise in the quiet steps moves the yardstick by its mean, not by its outliers alone
    noisy = [1.0, 1.0, 1.0, 1.5, 1.2, 1.2, 1.3, 1.5, 1.2, 1.2, 0.7]
    assert in_row_extra(_ends(noisy), 4, settle_s=2.0) == pytest.approx(0.9)
    # slow first steps (before any save) do not make the saves look cheaper
    slow_start = [2.0, 2.0, 2.0, *durations[3:]]
    assert in_row_extra(_ends(slow_start), 4, settle_s=2.0) == pytest.approx(0.9)


def test_lasting_extra_is_the_quiet_steps_slowdown_from_the_first_save_on():
    # quiet steps 10 % slower than a run without saves: 0.1 s on each of the 8 steps
    # from the first save on, over 2 saves
    durations = [1.0, 1.0, 1.0, 1.6, 1.3, 1.3, 1.1, 1.6, 1.3, 1.3, 1.1]
    split = split_steps(_ends(durations), 4, settle_s=2.0)
    assert (len(split.before), len(split.quiet), len(split.busy), split.saves) == (3, 2, 6, 2)
    assert lasting_extra(_ends(durations), 4, 2.0, base_step_s=1.0) == pytest.approx(0.4)
    # in-row + lasting make up the row-level figure when the first steps run at base pace
    row_level = (sum(durations) - len(durations) * 1.0) / 2
    in_row = in_row_extra(_ends(durations), 4, settle_s=2.0)
    assert in_row + lasting_extra(_ends(durations), 4, 2.0, 1.0) == pytest.approx(row_level)
    # quiet steps as fast as the no-saves run: nothing lasts
    assert lasting_extra(_ends(durations), 4, 2.0, base_step_s=1.1) == pytest.approx(0.0)
    # no quiet steps (saves closer together than their commit time), or no saves: None
    assert lasting_extra(_ends(durations), 4, 60.0, base_step_s=1.0) is None
    assert lasting_extra(_ends([1.0, 1.0, 1.0]), 4, 0.0, base_step_s=1.0) is None


def test_in_row_extra_needs_quiet_steps_and_saves():
    assert in_row_extra(_ends([2.0, 2.0, 2.0]), 1, settle_s=0.0) is None  # all save steps
    assert in_row_extra(_ends([1.0, 1.0, 1.0]), 4, settle_s=0.0) is None  # no save
    assert in_row_extra([], 4, settle_s=0.0) is None


def test_targets_met_and_not_met():
    rows = {
        "torch_save": {"extra_s": 30.0},
        "dcp_async_default": {"extra_s": 4.0},
        "dcp_async_best": {"extra_s": 2.0},
        "floor": {"blocked_s": 0.5},
        "floor_2tier": {"extra_s": 0.4},
        "unbroken": {
            "extra_s": 0.5,
            "blocked_s": 0.6,
            "commit_s": 11.0,
            "rss_growth": (1 << 30) + (10 << 20),
            "restore_local_s": 1.0,
            "restore_durable_s": 20.0,
        },
    }
    targets, ratios = evaluate(rows, ENV)
    met = {t.name: t.met for t in targets}
    assert met["time lost s/save <= 0.5 x best dcp.async_save"] is True  # 0.5 <= 1.0
    assert met["time lost s/save <= torch.save / 50"] is True  # 0.5 <= 0.6
    assert met["save to commit s <= 1.25 x (bytes/bandwidth + latency)"] is True  # 11 <= 12.525
    assert met["memory growth beyond one staging pool and the no-saves run's ~ 0"] is True
    assert met["restore local >= 0.8 x local disk bandwidth"] is True  # 2e9/1 / 2e9 = 1
    assert met["restore remote >= 0.8 x link bandwidth"] is False  # 1e8 / 2e8 = 0.5
    assert ratios["extra_wall_unbroken_over_best_dcp_async"] == pytest.approx(0.25)
    assert ratios["extra_wall_torch_save_over_unbroken"] == pytest.approx(60.0)
    assert ratios["restore_durable_fraction_of_link_bw"] == pytest.approx(0.5)
    assert ratios["blocked_unbroken_over_floor"] == pytest.approx(1.2)
    assert ratios["extra_wall_unbroken_over_floor_2tier"] == pytest.approx(1.25)
    assert ratios["extra_wall_torch_save_over_floor_2tier"] == pytest.approx(75.0)
    assert ratios["targets_met"] == 5


def test_rss_growth_target_counts_only_what_saves_add_to_the_loops_own_growth():
    pool = ENV["rank_bytes"]
    rows = {
        "baseline": {"rss_growth": 100 << 20},  # the loop alone keeps 100 MiB more
        "baseline_end": {"rss_growth": 40 << 20},
        "unbroken": {"rss_growth": pool + (150 << 20)},
    }
    targets, ratios = evaluate(rows, ENV)
    rss = next(t for t in targets if t.name.startswith("memory growth"))
    assert rss.measured == 50 << 20 and rss.met is True  # 150 - 100 MiB <= 64 MiB
    assert ratios["rss_growth_beyond_pool_gib"] == pytest.approx(150 / 1024)
    rows["unbroken"]["rss_growth"] = pool + (200 << 20)
    rss = next(t for t in evaluate(rows, ENV)[0] if t.name.startswith("memory growth"))
    assert rss.met is False  # 100 MiB beyond what the loop alone keeps


def test_a_missing_unbroken_row_reports_na_and_keeps_the_baselines():
    rows = {
        "dcp_async_best": {"extra_s": 2.0},
        "unbroken": {"error": "ModuleNotFoundError: No module named 'x'"},
    }
    targets, ratios = evaluate(rows, ENV)
    assert all(t.met is None for t in targets)
    assert ratios["extra_wall_unbroken_over_best_dcp_async"] is None
    text = format_targets(targets)
    assert text.count(": n/a") == len(targets)
    table = format_table(
        [
            {"name": "dcp.save", "blocked_s": 1.25, "peak_pss": 3 * GiB},
            {"name": "unbroken", "error": "ModuleNotFoundError: x"},
        ],
        all_columns=True,
    )
    lines = table.splitlines()
    assert lines[0].startswith("row") and set(lines[1]) <= {"-", " "}
    assert len({len(line) for line in lines[:4]}) == 1  # aligned columns
    assert "1.250" in lines[2] and "3.00" in lines[2]
    assert lines[3].split()[1:] == ["n/a"] * len(COLUMNS)
    assert lines[-1].strip() == "unbroken: n/a: ModuleNotFoundError: x"


def test_the_default_table_shows_the_compared_columns_and_all_columns_shows_the_rest():
    rows = [{"name": "unbroken", "extra_s": 0.25, "off_main_cpu_s": 0.75, "peak_pss": 3 * GiB}]
    short, full = format_table(rows), format_table(rows, all_columns=True)
    head = short.splitlines()[0]
    for title in ("time lost s/save", "save to commit s", "memory growth GiB", "restore remote s"):
        assert title in head  # every target's figure is in the default table
    assert "background CPU s/save" not in head and "0.750" not in short
    assert "background CPU s/save" in full and "0.750" in full and "3.00" in full
    assert len(short.splitlines()[2].split()) == 1 + len(shown_columns())
    assert len(full.splitlines()[2].split()) == 1 + len(COLUMNS) > 1 + len(shown_columns())


def test_json_line_is_one_line_with_nulls_for_nan():
    line = json_line({"a": math.nan, "b": 1.234567, "c": None}, {"quick": True, "d": 0.123456})
    assert "\n" not in line
    assert json.loads(line) == {"a": None, "b": 1.2346, "c": None, "quick": True, "d": 0.1235}


def test_model_shape_sizes():
    width, layers = model_shape(1 << 30)
    assert abs(width * width * layers * 4 - (1 << 30)) / (1 << 30) < 0.1
    assert model_shape(1 << 30) == (4096, 16)
    width, layers = model_shape(4e6)
    assert layers >= 2 and width >= 64
    width, layers = model_shape(4 << 20, 2)
    assert layers <= 4 and abs(width * width * layers * 4 - (4 << 20)) / (4 << 20) < 0.1


def test_cli_defaults_and_bad_arguments(capsys):
    quick = parse_args(["--quick", "--rows", "floor,unbroken"])
    assert quick.rows == ("baseline", "floor", "unbroken")
    twice = parse_args(["--quick", "--rows", "baseline,dcp_save", "--baseline-twice"])
    assert twice.rows == ("baseline", "dcp_save", "baseline_end")
    once = parse_args(["--rows", "dcp_save", "--no-baseline-twice"])
    assert once.rows == ("baseline", "dcp_save")
    assert quick.params_gb < 0.05 and not quick.isolate and quick.saves == 3
    full = parse_args(["--work-dir", "/tmp/x"])
    assert full.params_gb == 1.0 and full.saves == 20 and full.isolate
    assert full.rows[0] == "baseline" and full.rows[-1] == "baseline_end"
    with pytest.raises(SystemExit):
        parse_args(["--rows", "floor,tensorstore"])
    assert "tensorstore" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--saves", "0"])
    assert "--saves must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--every", "1"])  # step 1 is a warm-up save
    assert "--every must be at least 2" in capsys.readouterr().err


def test_baseline_is_the_mean_of_both_runs_and_their_spread_is_the_noise():
    assert baseline_loop({"baseline": {"loop_s": 10.0}, "baseline_end": {"loop_s": 12.0}}) == (
        11.0,
        2.0,
    )
    assert baseline_loop({"baseline": {"loop_s": 10.0}, "baseline_end": {"error": "x"}}) == (
        10.0,
        None,
    )
    assert baseline_loop({"baseline": {"error": "boom"}}) == (None, None)


def test_checksum_sees_every_byte_in_its_place():
    import torch

    a = torch.arange(12.0).reshape(3, 4)
    assert checksum([a]) == checksum([a.clone()])
    assert checksum([a]) != checksum([a.flip(0)])  # same values, other places
    assert len(checksum([torch.tensor(3.0), a.t(), torch.zeros(2, dtype=torch.bfloat16)])) == 3


def test_memory_sampler_sees_a_short_lived_allocation():
    import mmap
    import time

    from bench.checkpoint.measure import MemorySampler

    sampler = MemorySampler().start()
    base = sampler.sample()
    # A fresh mapping, not the allocator's: earlier tests in this process may have left
    # resident memory that a tensor allocation would reuse without raising RSS.
    block = mmap.mmap(-1, 256 << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1  # touched: resident
    deadline = time.monotonic() + 30  # on a loaded machine the sampler's turn comes late
    while sampler.peak - base < 200 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)  # the sampler thread, not this one, must see the block
    block.close()
    peak = sampler.stop()
    assert peak - base >= 200 << 20
    # freed again: measured from the peak, as other threads of this process (earlier
    # tests' background work) may grow meanwhile (CI: 120 MB above base after the free)
    assert peak - sampler.sample() >= 200 << 20


def test_memory_sampler_counts_the_rank_share_of_memory_tier_files():
    """unbroken's memory tier is shared memory no process maps: PSS would not see it."""
    import os

    from bench.checkpoint.measure import MemorySampler
    from unbroken.checkpoint.memory_tier import default_root

    root = default_root()  # in this test's own UNBROKEN_MEMORY_DIR (tests/conftest.py)
    os.makedirs(root, exist_ok=True)
    dead = Path(root) / "a-dead-jobs-tier"
    dead.mkdir()
    (dead / "shard").write_bytes(b"x" * (8 << 20))
    sampler = MemorySampler(tier_share=2)
    base = sampler.sample()
    (dead / "shard").unlink()  # swept by the row's manager: not the row's to count
    tier = Path(root) / "job" / "step-000000000001"
    tier.mkdir(parents=True)
    (tier / "__0_0.distcp").write_bytes(b"x" * (64 << 20))
    grown = sampler.sample() - base
    assert 28 << 20 <= grown <= 36 << 20, grown  # half of 64 MiB: two ranks share the node
    (tier / "__0_0.distcp").unlink()
    assert sampler.sample() - base < 2 << 20


def test_evicted_files_are_read_back_intact(tmp_path):
    from bench.checkpoint.measure import cold_read_bandwidth, evict_from_page_cache

    data = bytes(range(256)) * 4096
    (tmp_path / "d").mkdir()
    for name in ("a", "b"):
        (tmp_path / "d" / name).write_bytes(data)
    assert evict_from_page_cache(str(tmp_path / "d")) == 2 * len(data)
    bps = cold_read_bandwidth([str(tmp_path / "d" / "a"), str(tmp_path / "d" / "b")])
    assert bps is not None and bps > 0
    assert (tmp_path / "d" / "a").read_bytes() == data
    assert cold_read_bandwidth([]) is None


def test_report_judges_the_targets_on_the_per_save_figures_it_prints():
    """The rows' per-save deltas must reach the targets, not only the table."""
    cfg = parse_args(["--saves", "5", "--rows", "torch_save,dcp_async_best,unbroken"])
    loop = {"loop_s": 100.0, "machine_cpu_s": 150.0, "off_main_cpu_s": 10.0}
    row = {"state_bytes": 3 * GiB, "rank_bytes": 1.5 * GiB, "commit_s": 18.0}
    results = {
        "baseline": dict(loop),
        "baseline_end": dict(loop, loop_s=102.0),
        "torch_save": dict(row, loop_s=261.0, machine_cpu_s=250.0, off_main_cpu_s=60.0),
        "dcp_async_best": dict(row, loop_s=121.0, machine_cpu_s=200.0, off_main_cpu_s=10.0),
        "unbroken": dict(row, loop_s=103.0, machine_cpu_s=155.0, off_main_cpu_s=15.0),
    }
    text = report(cfg, results, started=0.0)
    best = "time lost s/save <= 0.5 x best dcp.async_save: measured 0.400, bound 2.000: MET"
    assert best in text
    assert "time lost s/save <= torch.save / 50: measured 0.400, bound 0.640: MET" in text
    ratios = json.loads(text.splitlines()[-1])
    assert ratios["extra_wall_unbroken_over_best_dcp_async"] == pytest.approx(0.1)
    unbroken_line = next(line for line in text.splitlines() if line.startswith("unbroken "))
    assert unbroken_line.split()[1:4] == ["n/a", "0.400", "18.000"]  # blocked, lost, commit
    cfg.all_columns = True
    text = report(cfg, results, started=0.0)
    unbroken_line = next(line for line in text.splitlines() if line.startswith("unbroken "))
    assert unbroken_line.split()[1:7] == ["n/a", "0.400", "n/a", "n/a", "18.000", "1.000"]


def test_report_shows_the_in_row_figure_beside_the_extra_wall_verdicts():
    cfg = parse_args(
        ["--saves", "2", "--every", "4", "--rows", "dcp_async_best,unbroken", "--all-columns"]
    )
    loop = {"loop_s": 11.0, "machine_cpu_s": 20.0, "off_main_cpu_s": 1.0}
    durations = [1.0, 1.0, 1.0, 1.5, 1.2, 1.2, 1.0, 1.5, 1.2, 1.2, 1.0]
    row = {"state_bytes": 3 * GiB, "rank_bytes": 1.5 * GiB, "every": 4, "commit_s": 2.0}
    results = {
        "baseline": dict(loop, every=4, step_ends_s=_ends([1.0] * 11)),
        "dcp_async_best": dict(row, loop_s=16.0, step_ends_s=_ends([1.4] * 11)),
        "unbroken": dict(row, loop_s=12.8, step_ends_s=_ends(durations)),
    }
    text = report(cfg, results, started=0.0)
    unbroken_line = next(line for line in text.splitlines() if line.startswith("unbroken "))
    # in-row 0.9; lasting: quiet steps of 1.0 s against the no-saves run's 1.0 s
    assert unbroken_line.split()[1:5] == ["n/a", "0.900", "0.900", "0.000"]
    verdict = "bound 1.250: MET (lost in run 0.900, after commit 0.000)"
    assert verdict in text
    # the no-saves run split like unbroken's saves: steady steps, no noise to show
    baseline_line = next(line for line in text.splitlines() if line.startswith("no saves "))
    assert baseline_line.split()[2:5] == ["n/a", "0.000", "0.000"]
