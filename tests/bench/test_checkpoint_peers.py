"""bench/peers/checkpoints.py and bench/checkpoint/gpu.py: their tables, JSON, plots and
arguments, the S3 rows' places on a real server, and the GPU script's exit without CUDA."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("matplotlib")

import bench.checkpoint.gpu as gpu_checkpoint
import bench.peers.checkpoints as peers
from bench.checkpoint.rows import RowContext
from bench.checkpoint.s3rows import S3Config, S3RowContext, S3TorchSave, aws_env, delete_prefix
from bench.common.paths import ROOT, child_env, module_argv
from bench.common.s3remote import S3Remote

GiB = float(1 << 30)


def _results() -> dict[str, dict]:
    row = {"state_bytes": 3 * GiB, "peak_pss": 2 * GiB}
    return {
        "baseline": {**row, "loop_s": 10.0},
        "s3_torch_save": {**row, "loop_s": 30.0, "blocked_s": 4.0, "commit_s": 9.0,
                          "restore_durable_s": 12.0},
        "s3_dcp_save": {**row, "loop_s": 20.0, "blocked_s": 2.0, "commit_s": 5.0,
                        "restore_durable_s": 4.0},
        "s3_dcp_async": {**row, "loop_s": 14.0, "blocked_s": 0.5, "commit_s": 6.0,
                         "restore_durable_s": 4.0},
        "s3_dcp_save_fsspec": {"error": "ClientError: boom"},
        "s3_unbroken": {**row, "loop_s": 11.0, "blocked_s": 0.1, "commit_s": 3.0,
                        "restore_durable_s": 2.0, "restore_local_s": 1.5,
                        # saves at steps 5 and 10 take 1 s more than a quiet step (1 s)
                        "every": 5, "step_ends_s": [1, 2, 3, 4, 6, 7, 8, 9, 10, 12]},
    }  # fmt: skip


def test_table_shows_extra_per_save_against_the_baseline_and_why_a_row_failed():
    results = _results()
    peers.add_extra_per_save(results, saves=2)
    assert results["s3_dcp_async"]["extra_s"] == pytest.approx(2.0)
    assert "extra_s" not in results["baseline"] and "extra_s" not in results["s3_dcp_save_fsspec"]
    table = peers.format_table(results, list(results))
    lines = table.splitlines()
    assert all(title in lines[0] for _, title, *_ in peers.COLUMNS)
    ub = next(line for line in lines if line.startswith("unbroken "))
    assert ub.split()[1:] == ["0.100", "0.500", "1.000", "3.00", "2.00", "1.50", "2.00"]
    dcp = next(line for line in lines if line.startswith("dcp.async_save"))
    assert dcp.split()[-2] == "n/a"  # no copy on the node to restore from
    fsspec = next(line for line in lines if line.startswith("dcp.save (FsspecWriter"))
    assert fsspec.split()[-7:] == ["n/a"] * 7
    assert "  dcp.save (FsspecWriter, s3fs): n/a: ClientError: boom" in lines


def test_summary_ratios_and_json_line():
    results = _results()
    peers.add_extra_per_save(results, saves=2)
    s = peers.summary(results, put_s=2.5)
    assert s["extra_best_peer_over_unbroken"] == pytest.approx(4.0)
    assert s["extra_torch_save_over_unbroken"] == pytest.approx(20.0)
    assert s["commit_unbroken_over_best_peer"] == pytest.approx(0.5)
    assert s["commit_unbroken_over_raw_put"] == pytest.approx(1.2)
    assert s["writer_s3torchconnector_over_fsspec_extra"] is None  # the fsspec row failed
    assert s["rows"]["s3_unbroken"]["peak_pss"] == pytest.approx(2.0)  # GiB
    line = peers.json_line({**s, "nan": float("nan"), "nested": [{"x": 1 / 3}]})
    back = json.loads(line)
    assert back["nan"] is None and back["nested"] == [{"x": 0.3333}]
    assert back["rows"]["s3_dcp_save_fsspec"] == {"error": "ClientError: boom"}


def test_scaling_points_table_and_plots(tmp_path):
    points = []
    for params, ranks in ((0.25, 1), (0.25, 2), (0.5, 1), (0.5, 2)):
        results = {
            "baseline": {"loop_s": 10.0, "peak_pss": 1.0 * GiB},
            "baseline_end": {"loop_s": 10.5, "peak_pss": 1.5 * GiB},
            "s3_dcp_async": {
                "state_bytes": 3 * params * GiB,
                "extra_s": params,
                "commit_s": 2.0,
                "blocked_s": 0.125,
                "peak_pss": 2.0 * GiB,
            },
            "s3_unbroken": {"state_bytes": 3 * params * GiB, "extra_s": params / 4, "commit_s": 1},
        }
        if ranks == 2 and params == 0.5:
            results["s3_unbroken"] = {"error": "timed out after 600 s"}
        points += peers.scaling_points(results, 3 * params, params, ranks, saves=2)
    assert len(points) == 8 and points[0]["state_gib"] == pytest.approx(0.75)
    assert points[0]["size_gib"] == pytest.approx(0.75)
    assert points[0]["noise_s"] == pytest.approx(0.25)  # the two no-saves loops, per save
    assert points[0]["blocked_s"] == 0.125 and points[0]["peak_gib"] == pytest.approx(2.0)
    assert points[0]["model_peak_gib"] == pytest.approx(1.5)  # the higher no-saves peak
    assert points[1]["blocked_s"] is None  # unbroken's row measured none here
    text = peers.format_scaling(points)
    assert "(timed out after 600 s)" in text
    assert len(text.splitlines()) == 9
    written = peers.plot_scaling(points, str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == [
        "checkpoint_scaling_size.png",
        "checkpoint_scaling_ranks.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in written)
    rows = _results()
    peers.add_extra_per_save(rows, 2)
    bars = peers.plot_rows(rows, list(rows), str(tmp_path / "rows.png"), "test")
    assert os.path.getsize(bars) > 1000


def _connector_installed(monkeypatch, installed: bool) -> None:
    """Whether ``parse_args`` finds s3torchconnector (the bench extra, absent in CI)."""
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(
        peers.importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if installed else None) if name == "s3torchconnector" else real(name, *a)
        ),
    )


def test_arguments_quick_and_full_defaults_and_bad_input(monkeypatch):
    _connector_installed(monkeypatch, True)
    quick = peers.parse_args(["--quick"])
    assert quick.params_gb == 1 / 16 and quick.saves == 2 and not quick.isolate
    full = peers.parse_args([])
    assert full.params_gb == 1.0 and full.isolate and full.sizes == [0.25, 0.5, 1.0, 2.0]
    assert full.ranks_list == [1, 2, 4] and full.rows == list(peers.PEER_ROWS)
    assert peers.parse_args(["--scaling", "--sizes", "0.03,0.06"]).sizes == [0.03, 0.06]
    for bad in (["--rows", "s3_nope"], ["--sizes", "a,b"], ["--ranks-list", "0"], ["--every", "1"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_without_s3torchconnector_its_rows_are_refused_up_front(monkeypatch, capsys):
    """Not n/a in every DCP cell after an hour of runs: the missing extra is named first."""
    _connector_installed(monkeypatch, False)
    for argv in ([], ["--scaling"], ["--rows", "s3_dcp_async"]):
        with pytest.raises(SystemExit):
            peers.parse_args(argv)
        err = capsys.readouterr().err
        assert "need s3torchconnector" in err and ".[bench]" in err
    assert peers.parse_args(["--rows", "s3_unbroken,s3_torch_save"]).rows == [
        "s3_unbroken",
        "s3_torch_save",
    ]


def test_s3_rows_write_under_their_own_prefix_and_prune_old_steps(s3_server, tmp_path, monkeypatch):
    """The torch.save row's files go to s3://<root>/<row>/step-*.pt; pruning deletes the
    old ones on the server (a full run writes far more than SeaweedFS's volumes hold)."""
    opts = s3_server.storage_options
    for k, v in aws_env(s3_server.endpoint_url, opts["key"], opts["secret"]).items():
        monkeypatch.setenv(k, v)
    cfg = S3Config(s3_root=s3_server.new_root(), s3_options=opts)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.Adam(model.parameters())
    row_dir = tmp_path / "s3_torch_save"
    ctx = RowContext(model, optim, 0, 2, str(row_dir), str(tmp_path / "work"), cfg.remote_options)
    row = S3TorchSave(ctx)
    assert isinstance(row.ctx, S3RowContext)
    assert row.ctx.store_url == f"s3://{cfg.s3_root}/s3_torch_save"
    assert row.ctx.remote_options == opts and row.ctx.fs_options() == opts
    full = {"model": model.state_dict(), "optim": optim.state_dict()}
    for step in (2, 4, 6):
        row._write_full(step, full)
        row.saved_steps.append(step)
        row._prune()
    bucket, prefix = cfg.s3_root.split("/", 1)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed) == [
        "step-000000004.pt",
        "step-000000006.pt",
    ]
    back = row._read_full(6)
    assert torch.equal(back["model"]["weight"], model.weight.detach())


def test_between_rows_the_server_is_emptied_and_compacted(s3_server, monkeypatch):
    """What runs between two rows against the real SeaweedFS: the run's objects go and
    its master compacts (answers the vacuum call); a dead master is reported, not raised."""
    opts = s3_server.storage_options
    for k, v in aws_env(s3_server.endpoint_url, opts["key"], opts["secret"]).items():
        monkeypatch.setenv(k, v)
    root = s3_server.new_root()
    bucket, prefix = root.split("/", 1)
    client = s3_server.client()
    for n in range(3):
        client.put_object(Bucket=bucket, Key=f"{prefix}/row/step-{n}", Body=b"x" * 1000)
    assert delete_prefix(f"s3://{root}") == 3
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    vacuum = peers.Vacuum(S3Remote(server=s3_server))
    vacuum.once()
    assert vacuum.count == 1
    vacuum.url = "http://127.0.0.1:9/vol/vacuum"  # nothing listens on the discard port
    vacuum.once()
    assert vacuum.count == 1


def test_gpu_script_without_cuda_says_so_and_exits_without_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    proc = subprocess.run(
        module_argv("bench.checkpoint.gpu", "--params-gb", "0.5"),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == gpu_checkpoint.NO_CUDA_EXIT
    assert "no CUDA device here" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_script_arguments_and_table():
    cfg = gpu_checkpoint.parse_args(["--rows", "unbroken,dcp_async", "--params-gb", "2"])
    assert cfg.rows == ("baseline", "unbroken", "dcp_async") and cfg.params_gb == 2.0
    with pytest.raises(SystemExit):
        gpu_checkpoint.parse_args(["--rows", "nope"])
    results = {
        "baseline": {"loop_s": 8.0, "peak_host_gib": 3.0, "peak_gpu_gib": 12.0},
        "unbroken": {"loop_s": 9.0, "blocked_s": 0.01, "commit_s": 2.0, "restore_s": 1.0,
                     "peak_host_gib": 6.0, "peak_gpu_gib": 12.5, "in_save_s": 0.02,
                     "busy_s": 0.0, "copy_s": 0.07, "check_s": 0.008},
        "dcp_async": {"error": "RuntimeError: pinned"},
    }  # fmt: skip
    gpu_checkpoint.add_extra(results, saves=4)
    table = gpu_checkpoint.format_table(results, cfg.rows)
    ub = next(line for line in table.splitlines() if line.startswith("unbroken"))
    assert ub.split()[1:] == [
        "0.010", "0.250", "2.00", "1.00", "6.00", "12.50", "0.020", "0.000", "0.070", "0.008"
    ]  # fmt: skip
    assert "dcp.async_save (pinned, async staging): n/a: RuntimeError: pinned" in table
