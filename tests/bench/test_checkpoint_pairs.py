"""bench/checkpoint/pairs.py: the pair arithmetic, the CLI, and a quick run on real ranks."""

from __future__ import annotations

import json
import os

import pytest

from bench.checkpoint.pairs import parse_args
from bench.checkpoint.pairs_math import (
    Pair,
    difference,
    estimate,
    pairs_from_records,
    steps_in_flight,
    summarize,
    whole_rounds,
)

from .scripts import run_bench_script

COST = [0.0, 0.7, 0.1, 0.0, 0.0, 0.0]
"""What a save adds at each step position of its block, in the synthetic runs below."""


def abba(
    pairs: int, drift_per_step: float, base: float = 6.0, call: float | None = None
) -> list[dict]:
    """Records of a run whose every step is ``drift_per_step`` slower than the one before,
    with blocks in the probe's order: save/none, none/save, ..."""
    records, t = [], 0
    for index in range(pairs):
        for kind in ("save", "none") if index % 2 == 0 else ("none", "save"):
            steps = []
            for cost in COST:
                steps.append(base + drift_per_step * t + (cost if kind == "save" else 0.0))
                t += 1
            save = kind == "save"
            records.append(
                {
                    "pair": index,
                    "kind": kind,
                    "steps": steps,
                    "save_at": steps[0] if save else None,
                    "commit": 2 * base if save else None,
                }
            )
            if call is not None:
                records[-1]["call"] = call if save else None
    return records


def test_abba_order_cancels_a_steady_drift():
    pairs = pairs_from_records(abba(4, drift_per_step=0.05), skip=0)
    s = summarize(pairs)
    # The save call and two more steps start before the commit 12 s after the call.
    assert [p.in_flight for p in pairs] == [3, 3, 3, 3]
    assert s["in_flight"].mean == pytest.approx(0.8)
    assert s["after_commit"].mean == pytest.approx(0.0, abs=1e-9)
    assert s["whole_block"].mean == pytest.approx(0.8)
    assert s["whole_block"].median == pytest.approx(0.8)
    assert [e.mean for e in s["per_position"]] == pytest.approx(COST)
    # Each order alone is off by the drift over one block (5 positions after the call x
    # 6 steps x 0.05 s = 1.5 s), one way or the other: that spread is what the standard
    # error shows.
    assert s["whole_block"].se == pytest.approx(1.5 * (4 / 3) ** 0.5 / 2)


def test_in_flight_is_the_save_call_and_the_steps_after_it():
    """The step making the call differs by what ran before the call too (noise): only
    the call's own seconds count from it."""
    records = abba(3, drift_per_step=0.0, call=0.05)
    for index, rec in enumerate(records):
        if rec["kind"] == "save":  # noise before the call, different in every pair
            rec["steps"][0] += 0.3 * (index % 3) + 0.05
    s = summarize(pairs_from_records(records, skip=0))
    assert s["in_flight"].mean == pytest.approx(0.05 + 0.7 + 0.1)
    assert s["in_flight"].se == pytest.approx(0.0, abs=1e-12)
    assert s["whole_block"].mean == pytest.approx(s["in_flight"].mean + s["after_commit"].mean)
    assert s["per_position"][0].mean > 0.05  # the noise is still shown where it is
    # A log from before the call was timed: the call counts as 0 s.
    old = summarize(pairs_from_records(abba(3, drift_per_step=0.0), skip=0))
    assert old["in_flight"].mean == pytest.approx(0.8)


def test_without_drift_the_cost_is_exact_and_the_error_zero():
    s = summarize(pairs_from_records(abba(3, drift_per_step=0.0), skip=1))
    assert s["whole_block"].mean == pytest.approx(0.8) and s["whole_block"].n == 2
    assert s["whole_block"].se == pytest.approx(0.0, abs=1e-12)


def test_steps_in_flight_counts_the_steps_started_before_the_commit():
    assert steps_in_flight([6.0] * 6, save_at=6.0, commit_s=13.0) == 4  # 0, 6, 12, 18 < 19
    assert steps_in_flight([6.0] * 6, save_at=6.0, commit_s=12.0) == 3  # 18 is not < 18
    assert steps_in_flight([6.0] * 3, save_at=6.0, commit_s=100.0) == 3
    assert steps_in_flight([6.0] * 3, save_at=0.0, commit_s=0.0) == 1


def test_bad_pairs_and_records_are_refused():
    with pytest.raises(ValueError, match="same, nonzero length"):
        Pair((1.0, 2.0), (1.0,), 1)
    with pytest.raises(ValueError, match=r"in_flight must be 1\.\.2"):
        Pair((1.0, 2.0), (1.0, 2.0), 0)
    with pytest.raises(ValueError, match="no pairs"):
        summarize([])
    with pytest.raises(ValueError, match="same number of steps"):
        summarize([Pair((1.0,), (1.0,), 1), Pair((1.0, 2.0), (1.0, 2.0), 1)])
    with pytest.raises(ValueError, match="no values"):
        estimate([])
    records = abba(2, 0.0)
    records[-1 if records[-1]["kind"] == "save" else -2]["commit"] = None
    with pytest.raises(ValueError, match="pair 1: its save has no save or commit time"):
        pairs_from_records(records, skip=0)
    # A pair cut short (the job stopped between its blocks) is left out.
    assert len(pairs_from_records(abba(2, 0.0)[:-1], skip=0)) == 1


def test_cli_defaults_and_bad_arguments():
    a = parse_args([])
    assert (a.params_gb, a.pairs, a.block, a.skip, a.minutes) == (1.0, 20, 10, 1, None)
    q = parse_args(["--quick"])
    assert (q.pairs, q.block, q.skip) == (2, 3, 0) and q.params_gb < 0.1
    assert a.also == () and parse_args(["--also", "floor_2tier"]).also == ("floor_2tier",)
    for bad in (
        ["--pairs", "0"],
        ["--block", "0"],
        ["--skip", "20"],
        ["--params-gb", "0"],
        ["--also", "floor_2tier,torch_save"],  # not a saver a round can hold
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def with_another_saver(records: list[dict], extra: float) -> list[dict]:
    """``records`` plus, in every round, a block saved another way that costs ``extra``
    more than the save at each position."""
    out = list(records)
    for rec in records:
        if rec["kind"] == "save":
            other = dict(rec, kind="floor_2tier", steps=[x + extra for x in rec["steps"]])
            out.append(other)
    return out


def test_another_saver_is_reported_beside_unbroken_and_against_it():
    records = with_another_saver(abba(3, 0.0), extra=0.1)
    theirs = summarize(pairs_from_records(records, skip=0, kind="floor_2tier"))
    assert theirs["whole_block"].mean == pytest.approx(0.8 + 5 * 0.1)  # from the call on
    gap = difference(records, 0, "save", "floor_2tier")
    assert gap.mean == pytest.approx(-0.5) and gap.n == 3
    # A round cut short (here: before its block without a save) is left out of all three.
    cut = [r for r in records if not (r["pair"] == 2 and r["kind"] == "none")]
    kept = whole_rounds(cut)
    assert {r["pair"] for r in kept} == {0, 1} and len(kept) == 6
    assert len(pairs_from_records(kept, 0, "floor_2tier")) == 2
    assert difference(kept, 0, "save", "floor_2tier").n == 2
    # unbroken's own pairs do not change with a third block in the round
    ours = summarize(pairs_from_records(records, skip=0))
    assert ours["whole_block"].mean == pytest.approx(0.8)


def test_report_from_a_kept_log(tmp_path):
    log = tmp_path / "pairs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in abba(3, 0.01)))
    out = run_pairs("--from-log", str(log), timeout=60)
    last = json.loads(out.strip().splitlines()[-1])
    assert last["pairs"] == 2
    assert last["whole_block"]["mean"] == pytest.approx(0.8, abs=0.01)
    log.write_text("".join(json.dumps(r) + "\n" for r in with_another_saver(abba(3, 0.0), 0.1)))
    last = json.loads(run_pairs("--from-log", str(log), timeout=60).strip().splitlines()[-1])
    assert last["floor_2tier"]["whole_block"]["mean"] == pytest.approx(1.3)
    assert last["save_minus_floor_2tier"]["mean"] == pytest.approx(-0.5)


def test_logs_of_two_runs_are_reported_pooled(tmp_path):
    """Each log's first pair is dropped and the rest are pooled: 2 + 3 pairs here."""
    paths = []
    for name, pairs, cost in (("a.jsonl", 3, 0.0), ("b.jsonl", 4, 0.3)):
        records = abba(pairs, 0.0)
        for r in records[2:]:  # every pair's save block after the first costs `cost` more
            if r["kind"] == "save":
                r["steps"][1] += cost
        paths.append(tmp_path / name)
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run_pairs("--from-log", str(paths[0]), "--from-log", str(paths[1]), timeout=60)
    assert "over 5 pairs (first 1 of each of 2 logs dropped)" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["pairs"] == 5
    assert last["whole_block"]["mean"] == pytest.approx(0.8 + 0.3 * 3 / 5)
    with pytest.raises(SystemExit, match=f"cannot report {paths[0]}, {tmp_path}/missing"):
        from bench.checkpoint.pairs import report_log

        report_log([str(paths[0]), str(tmp_path / "missing.jsonl")], skip=1)


def test_a_log_that_cannot_be_reported_is_refused_by_name(tmp_path):
    from bench.checkpoint.pairs import report_log

    cases = {
        "missing.jsonl": None,
        "garbled.jsonl": '{"pair": 0, "kind": "save", "steps": [1.0\n',
        "no-fields.jsonl": '{"pair": 0}\n',
        "no-pairs.jsonl": json.dumps(abba(1, 0.0)[0]) + "\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit, match=f"cannot report {path}: ") as info:
            report_log(str(path), skip=0)
        assert "Traceback" not in str(info.value)
    assert "missing field 'kind'" in _refusal(report_log, tmp_path / "no-fields.jsonl")
    assert "no pairs" in _refusal(report_log, tmp_path / "no-pairs.jsonl")


def _refusal(report_log, path) -> str:
    with pytest.raises(SystemExit) as info:
        report_log(str(path), skip=0)
    return str(info.value)


def run_pairs(*args: str, timeout: float) -> str:
    return run_bench_script("bench.checkpoint.pairs", *args, timeout=timeout)[0]


@pytest.mark.slow  # the bench's own run (make bench); its parts are tested above
@pytest.mark.multiprocess
def test_quick_run_on_two_ranks_with_the_floor_and_shared_staging_alongside(tmp_path):
    also = "floor_2tier,unbroken_shared"
    out = run_pairs(
        "--quick", "--also", also, "--keep", "--work-dir", str(tmp_path / "w"), timeout=300
    )
    last = json.loads(out.strip().splitlines()[-1])
    assert last["pairs"] == 2
    for key in ("in_flight", "after_commit", "whole_block"):
        assert isinstance(last[key]["mean"], float)
    assert isinstance(last["floor_2tier"]["whole_block"]["mean"], float)
    assert isinstance(last["save_minus_floor_2tier"]["mean"], float)
    assert "unbroken minus floor + 2 disk writes, whole block:" in out
    assert isinstance(last["save_minus_unbroken_shared"]["mean"], float)
    records = [json.loads(line) for line in (tmp_path / "w" / "pairs.jsonl").open()]
    # Rounds alternate forward and backward, so no way of saving always goes first.
    assert [(r["pair"], r["kind"]) for r in records] == [
        (0, "save"),
        (0, "none"),
        (0, "floor_2tier"),
        (0, "unbroken_shared"),
        (1, "unbroken_shared"),
        (1, "floor_2tier"),
        (1, "none"),
        (1, "save"),
    ]
    for r in records:
        if r["kind"] != "none":
            assert r["commit"] > 0 and len(r["steps"]) == 3
            assert 0 <= r["call"] <= r["steps"][0]  # the call is timed, inside step 0
    # Each save committed a checkpoint of its own, kept by the row's retention; the
    # second manager has a remote and a local tier of its own.
    for key in ("unbroken", "unbroken_shared"):
        assert len(os.listdir(tmp_path / "w" / "remote" / key)) >= 2
    assert os.path.isdir(tmp_path / "w" / "unbroken_shared" / "unbroken-staging")
    # The floor wrote every rank's bytes to the remote's directory too.
    floor = os.listdir(tmp_path / "w" / "remote" / "floor_2tier")
    assert {name.rsplit("-", 1)[1] for name in floor} == {"rank0.bin", "rank1.bin"}
