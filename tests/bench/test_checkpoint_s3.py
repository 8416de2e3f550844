"""bench/checkpoint/saves.py --s3: the table, the limits, the targets and the JSON line; and a
tiny real run against the SeaweedFS server (seconds)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("obstore")
pytest.importorskip("boto3")

import bench.checkpoint.s3 as s3
from bench.checkpoint.saves import _parser, s3_config


def _m(mbps: float, server: float = 0.2, client: float = 0.2, machine: float | None = None):
    seconds = 1.0
    return s3.Measured(int(mbps * s3.MB), seconds, client, server, 0.0, machine)


def _result() -> s3.ProfileResult:
    r = s3.ProfileResult("loopback", 0.0, nbytes=300_000_000)
    r.commit = {"unbroken": [_m(90), _m(95)], "obstore": [_m(100)], "boto3": [_m(60)]}
    r.restore = {"unbroken": [_m(200, client=1.9)], "obstore": [_m(500)], "boto3": [_m(400)]}
    r.phases = {"staging": 0.1, "upload": 3.0, "total": 3.2}
    return r


def test_rows_take_the_best_rep_and_hold_unbroken_to_the_fastest_raw_client():
    table = s3.rows([_result()], cores=2)
    commit, restore = table
    assert commit["unbroken"] == pytest.approx(95) and commit["raw"] == "obstore"
    assert commit["ratio"] == pytest.approx(0.95)
    assert restore["ratio"] == pytest.approx(0.4)
    assert restore["limit_unbroken"].startswith("machine CPU (2 cores full, most to the client)")
    assert commit["limit_raw"].startswith("link / server I/O")
    verdicts = [met for _, _, met in s3.targets(table)]
    assert verdicts == [True, False]


def test_limits_name_who_was_busy():
    assert s3.limit(_m(100, server=0.95), 2, 0.0).startswith("server CPU")
    assert s3.limit(_m(100, client=0.9), 2, 0.0).startswith("client CPU")
    assert s3.limit(_m(100), 2, 20.0).startswith("latency (20 ms/request)")
    others = s3.limit(_m(100, machine=1.9), 2, 0.0)
    assert "most to the rest)" in others and "rest 1.50" in others


def test_report_prints_the_table_targets_and_a_json_line():
    cfg = s3.S3Config(params_gb=0.1, profiles=("loopback",), reps=2, quick=True)
    out = s3.report([_result()], cfg, "server: test", {"quick": True}).splitlines()
    head = next(line for line in out if line.startswith("profile"))
    assert head.split("  ")[0:1] == ["profile"] and "x raw" in head
    commit = next(line for line in out if line.startswith("loopback  commit"))
    assert commit.split()[2:] == ["95", "100", "60", "0.95x"]
    assert any("commit >= 0.9x raw put (obstore): measured 0.95x: MET" in x for x in out)
    assert any("restore >= 0.9x raw get (obstore): measured 0.40x: NOT MET" in x for x in out)
    data = json.loads(out[-1])
    assert data["targets_met"] == 1 and data["targets_total"] == 2
    assert data["rows"][0]["unbroken"] == 95.0 and data["phases"]["loopback"]["upload"] == 3.0


def test_s3_options_parse():
    cfg = s3_config(_parser().parse_args(["--s3", "--quick", "--profile", "far"]))
    assert cfg.profiles == ("far",) and cfg.reps == 2 and cfg.quick
    assert s3_config(_parser().parse_args(["--s3"])).profiles == ("loopback", "far")


def test_a_tiny_real_profile_commits_restores_and_measures_every_column(s3_server, tmp_path):
    from bench.common.s3remote import S3Remote

    model, optim = s3.build_state(0.002)
    cfg = s3.S3Config(params_gb=0.002, profiles=("loopback",), reps=1, work_dir=str(tmp_path))
    remote = S3Remote(0.0, s3_server)
    result = s3.run_profile(remote, "loopback", cfg, {"model": model, "optim": optim})
    assert result.nbytes > 2.5 * 0.002 * (1 << 30)  # params + Adam moments (+ headers)
    for cells in (result.commit, result.restore):
        assert sorted(cells) == sorted(s3.COLUMNS)
        assert all(len(v) == 1 and v[0].seconds > 0 for v in cells.values())
    assert "upload" in result.phases
