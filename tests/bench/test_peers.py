"""bench/peers/loaders.py's accounting and table (pure functions), and what a failed row
leaves; no peers venv needed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

import bench.peers.accounting as acc
import bench.peers.loaders as peers
import bench.peers.setup as _peer_setup
from bench.common.paths import ROOT, child_env, module_argv
from bench.peers.loader_rows import DiskPeak, compare_shards, log_boto_retries

SOURCE = {"a.jpg": acc.crc_of(b"a"), "b.jpg": acc.crc_of(b"b"), "c.jpg": acc.crc_of(b"c")}


def test_a_clean_pass_is_exact():
    delivered = [(k, crc) for k, crc in SOURCE.items()]
    got = acc.account(delivered, SOURCE)
    assert got.exact and got.delivered == 3
    assert acc.resume_cell(got.as_dict()) == "exact"


def test_resume_that_replays_and_skips_counts_duplicates_and_missing():
    before = [("a.jpg", SOURCE["a.jpg"]), ("b.jpg", SOURCE["b.jpg"])]
    after = [("b.jpg", SOURCE["b.jpg"]), ("b.jpg", SOURCE["b.jpg"])]  # replayed twice, c lost
    got = acc.account(before + after, SOURCE)
    assert (got.delivered, got.duplicates, got.missing) == (4, 2, 1)
    assert acc.resume_cell(got.as_dict()) == "2 dup, 1 missing"


def test_another_requests_bytes_are_a_mismatch_not_a_pass():
    # a worker got b's bytes in answer to a's request: the key is right, the bytes are not
    delivered = [("a.jpg", SOURCE["b.jpg"]), ("b.jpg", SOURCE["b.jpg"]), ("c.jpg", SOURCE["c.jpg"])]
    got = acc.account(delivered, SOURCE)
    assert got.mismatched == 1 and got.duplicates == 0 and got.missing == 0
    assert not got.exact
    assert "1 bad bytes" in acc.resume_cell(got.as_dict())


def test_keys_outside_the_source_are_unknown():
    got = acc.account([("zzz.jpg", 1), *[(k, c) for k, c in SOURCE.items()]], SOURCE)
    assert got.unknown == 1 and got.missing == 0


def test_collated_batch_yields_key_crc_pairs():
    batch = (torch.zeros(2, 3, 4, 4), torch.tensor([SOURCE["a.jpg"], SOURCE["c.jpg"]]),
             ["a.jpg", "c.jpg"])  # fmt: skip
    assert acc.delivered_of_batch(batch) == [("a.jpg", SOURCE["a.jpg"]), ("c.jpg", SOURCE["c.jpg"])]


def test_resume_cell_passes_reasons_through():
    assert acc.resume_cell("no state") == "no state"
    assert acc.resume_cell(None) == "-"


EXACT = {"delivered": 3, "duplicates": 0, "missing": 0, "mismatched": 0, "unknown": 0}


def _result(row: str, e1: float, e2: float, **extra) -> dict:
    epoch = {"images": 512, "seconds": 1.0, "first_batch_s": 0.5, "cpu_ms": 4.0}
    return {
        "row": row,
        "conversion_s": None,
        "peak_cache_bytes": 0,
        "epoch1": {**epoch, "rate": e1},
        "epoch2": {**epoch, "rate": e2},
        "epoch_check": acc.account([(k, c) for k, c in SOURCE.items()], SOURCE).as_dict(),
        "resume_workers": "no state",
        "resume_world": "no state",
        **extra,
    }


def test_table_shows_every_row_its_error_and_the_resume_columns():
    results = [
        _result("stock", 300, 310),
        _result("unbroken", 600, 900, peak_cache_bytes=50 << 20, resume_workers=EXACT),
        _result("streaming", 700, 720, conversion_s=3.25),
        {"row": "litdata", "error": "ValueError: boom"},
    ]
    text = peers.table(results)
    lines = text.splitlines()
    assert all(t in lines[0] for t in peers.TITLES)
    unbroken = next(line for line in lines if line.startswith("unbroken"))
    assert unbroken.split()[1:5] == ["600", "900", "1.0", "0.50"] and "50.0 MB" in unbroken
    assert "exact" in unbroken and "no state" in lines[1]
    streaming = next(line for line in lines if line.startswith("MosaicML")).split()
    assert streaming[streaming.index("3.2") + 1] == "4.2"  # raw files to epoch 1's end
    assert unbroken.split()[5:7] == ["-", "1.0"]  # nothing to convert: epoch 1 alone
    assert "error: ValueError: boom" in next(line for line in lines if line.startswith("LitData"))
    assert len({len(line) for line in lines[:4]}) == 1  # aligned


def test_ratios_say_where_unbroken_leads_and_trails():
    got = peers.ratios([_result("stock", 300, 300), _result("unbroken", 600, 150)])
    assert got == {"stock": {"epoch1": 2.0, "epoch2": 0.5}}


def test_best_peer_and_curves_skip_failed_rows():
    results = [_result("stock", 900, 1), _result("litdata_raw", 500, 1),
               _result("streaming", 700, 1), {"row": "litdata", "error": "x"}]  # fmt: skip
    assert peers.best_peer(results) == "streaming"
    for r, w in zip(results, (2, 1, 4, 2)):
        r["workers"] = w
    curves = peers.curve_points(results, "workers")
    assert curves == {"stock": [(2, 900)], "litdata_raw": [(1, 500)], "streaming": [(4, 700)]}


def test_constraints_pin_each_package():
    text = _peer_setup.constraints({"torch": "2.13.0+cpu", "pillow": "13.0.0"})
    assert text == "pillow==13.0.0\ntorch==2.13.0+cpu\n"


def test_unknown_row_is_refused():
    with pytest.raises(SystemExit):
        peers.parse_args(["--rows", "stock,dali"])


def test_a_long_refusal_becomes_a_note_under_the_table():
    refusal = "error: AssertionError: assert self._num_workers == state_dict[self._NUM_WORKERS]"
    text = peers.table([_result("stateful", 70, 80, resume_workers=refusal)])
    row = next(line for line in text.splitlines() if line.startswith("torchdata"))
    assert "see [1]" in row and refusal not in row
    assert text.splitlines()[-1] == f"[1] {refusal}"


def test_a_file_count_that_leaves_partial_batches_is_refused():
    # 64 files, batch 32: the resumed half (32) cannot fill a batch at world size 2
    with pytest.raises(SystemExit):
        peers.parse_args(["--files", "64"])
    assert peers.parse_args(["--files", "128"]).files == 128


def test_scaling_table_lists_each_row_at_each_point_and_skips_failures():
    scaling = {
        "workers": [
            {"row": "stock", "workers": 1, "epoch1": {"rate": 100.4}},
            {"row": "stock", "workers": 2, "epoch1": {"rate": 180.0}},
            {"row": "unbroken", "workers": 1, "epoch1": {"rate": 300.0}},
            {"row": "unbroken", "workers": 2, "error": "boom"},
        ],
        "latency": [{"row": "unbroken", "latency_ms": 20.0, "epoch1": {"rate": 250.0}}],
    }
    lines = peers.scaling_table(scaling).splitlines()
    assert "1 workers" in lines[0] and "2 workers" in lines[0]
    stock = next(line for line in lines if line.startswith("stock"))
    assert stock.split()[-2:] == ["100", "180"]
    unbroken = next(line for line in lines if line.startswith("unbroken"))
    assert unbroken.split()[-2:] == ["300", "failed"]  # a failed point says so
    assert any(line.startswith("epoch 1 img/s by latency") and "20 ms" in line for line in lines)


def test_a_failed_row_keeps_its_files_the_newest_failure_only(tmp_path):
    """A peer that returned a wrong sample leaves its local copy to compare afterwards."""
    failed = tmp_path / "failed"
    for n in range(2):
        work = tmp_path / f"no_such_row-{n}"
        work.mkdir()
        (work / "shard.00000.mds").write_bytes(b"shard %d" % n)
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"row": "no_such_row", "work": str(work),
                                    "failed_dir": str(failed)}))  # fmt: skip
        done = subprocess.run(
            module_argv("bench.peers.loader_rows", str(spec), python=sys.executable),
            capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.split("ROW ", 1)[1])
        assert "no_such_row" in result["error"]
        assert f"kept in {failed / work.name}" in done.stderr
        assert not work.exists()
    assert sorted(p.name for p in failed.iterdir()) == ["no_such_row-1"]  # the newest only
    assert (failed / "no_such_row-1" / "shard.00000.mds").read_bytes() == b"shard 1"


def test_a_kept_shard_is_compared_with_the_objects_on_the_server(tmp_path, s3_server):
    """A wrong sample is traced to its place: the kept shard is the server's object, or
    another shard's bytes (gone wrong on the way), or neither."""
    from tests.s3server import CREDENTIALS

    root = s3_server.new_root()
    bucket, _, prefix = root.partition("/")
    shards = {"shard.00000.mds": b"0" * 70_000 + b"tail0", "shard.00001.mds": b"1" * 70_000}
    client = s3_server.client()
    for name, data in shards.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    kept = tmp_path / "streaming-bench"
    kept.mkdir()
    (kept / "shard.00000.mds").write_bytes(shards["shard.00000.mds"])
    (kept / "shard.00001.mds").write_bytes(b"0" * 70_000)  # shard 0's bytes, shard 1's name
    spec = {"endpoint": s3_server.endpoint_url, "key": CREDENTIALS["key"],
            "secret": CREDENTIALS["secret"], "mds": root}  # fmt: skip
    lines = compare_shards(str(tmp_path), spec)
    assert lines[0] == "shard.00000.mds: bitwise the server's object"
    assert lines[1].startswith("shard.00001.mds: differs from the server's object")
    assert "first differing byte 0" in lines[1]
    assert "are those of ['shard.00000.mds']" in lines[1]


def test_the_cache_sampler_counts_its_own_cpu_so_the_row_is_not_charged_for_it(tmp_path):
    """A walk of a per-file cache costs milliseconds; rows that cache per file would pay
    for being measured if the sampler's CPU stayed in the loader's."""
    for i in range(400):
        (tmp_path / f"{i % 16:02x}").mkdir(exist_ok=True)
        (tmp_path / f"{i % 16:02x}" / f"f{i}").write_bytes(b"x" * 10)
    peak = DiskPeak(str(tmp_path), every=0.001)
    time.sleep(0.3)
    assert peak.stop() == 4000
    assert peak.cpu_seconds > 0
    assert DiskPeak(None).stop() == 0 and DiskPeak(None).cpu_seconds == 0


def test_the_cache_sampler_spaces_its_walks_by_what_they_cost(tmp_path):
    """What a walk costs the loader's other threads cannot be taken out: a sampler that
    walked 4,000 files as often as asked would hold the loader's GIL most of the time."""
    for i in range(4000):
        (tmp_path / f"{i % 16:02x}").mkdir(exist_ok=True)
        (tmp_path / f"{i % 16:02x}" / f"f{i}").write_bytes(b"x")
    peak = DiskPeak(str(tmp_path), every=0.0001, duty=0.05)
    time.sleep(1.0)
    assert peak.stop() == 4000
    # each walk takes milliseconds: at most a twentieth of the second was spent walking
    assert peak.walks >= 1 and peak.cpu_seconds < 0.2


def test_the_streaming_row_says_each_retried_request_and_nothing_else(capsys):
    """A 60 s stall (the read timeout of Streaming's client) shows in the run's log as
    the failed request and its retry; the request log itself stays out."""
    endpoint = logging.getLogger("botocore.endpoint")
    before = list(endpoint.handlers)
    log_boto_retries()
    try:
        endpoint.debug("Sending http request: %s", "<GET shard.00000.mds>")
        try:
            raise TimeoutError("Read timeout on endpoint URL")
        except TimeoutError:
            endpoint.debug("Exception received when sending HTTP request.", exc_info=True)
        logging.getLogger("botocore.retries.standard").debug(
            "Retry needed, retrying request after delay of: %s", 0.5
        )
    finally:
        for name in ("botocore.endpoint", "botocore.retries.standard"):
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if h not in before]:
                logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)
    said = capsys.readouterr().err
    assert "Sending http request" not in said
    assert "Exception received" in said and "Read timeout on endpoint URL" in said
    assert "Retry needed, retrying request after delay of: 0.5" in said
