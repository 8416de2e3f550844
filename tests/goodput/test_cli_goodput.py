"""``unbroken goodput`` on logs real jobs wrote: several jobs on one root, a finished job
run again, a damaged line, where ``--plot`` writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import unbroken as ub
from unbroken.cli.main import main
from unbroken.goodput import events as ev

from .helpers import JOB, env, make_volume, train


def goodput(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["goodput", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def job(tmp_path, url: str, staging: str, *args: str, job_id: str | None = None):
    e = env()
    e.pop("UNBROKEN_JOB_ID", None)
    if job_id is not None:
        e["UNBROKEN_JOB_ID"] = job_id
    data = tmp_path / "data"
    if not data.exists():
        make_volume(data)
    cmd = [sys.executable, str(JOB), "--url", url, "--staging", staging, "--data", str(data)]
    cmd += args
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.multiprocess
def test_two_jobs_on_one_root_are_told_apart(capsys, tmp_path):
    url = str(tmp_path / "ck")
    # No save before the end (8 s in): a job that starts late must not find the other's
    # step 10 and restore it (seen: first_step 11 when one started 0.5 s after the other).
    slow = ("--step-seconds", "0.2", "--every", "1000")
    procs = [
        job(tmp_path, url, str(tmp_path / f"st{name}"), *slow, job_id=name)
        for name in ("job-a", "job-b")
    ]
    for p in procs:
        p.communicate(timeout=300)  # one may fail: two jobs saving to one URL is refused
    code, out, err = goodput(capsys, url, "--json")  # the newest, the others named
    assert code == 0 and "2 jobs" in err and "job-a" in err and "job-b" in err
    assert "--job" in err and f"the newest, {json.loads(out)['job']}" in err
    for name in ("job-a", "job-b"):
        code, out, _ = goodput(capsys, url, "--json", "--job", name)
        report = json.loads(out)
        assert code == 0 and report["job"] == name
        assert report["restarts"] == 0 and report["wasted_steps"] == 0
        assert len(report["attempts"]) == 1 and report["attempts"][0]["first_step"] == 1
    code, _, err = goodput(capsys, url, "--job", "job-c")
    assert code == 2 and "no job 'job-c'" in err and "job-a" in err


@pytest.mark.multiprocess
def test_a_finished_job_run_again_is_a_second_run_not_a_restart(capsys, tmp_path):
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    for steps in ("20", "40"):  # the second run restores step 20 and trains on
        p = job(tmp_path, url, staging, "--steps", steps)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    code, out, _ = goodput(capsys, url, "--json")
    report = json.loads(out)
    assert code == 0, out
    assert report["restarts"] == 0 and report["runs"] == 2
    assert report["seconds"]["down"] == 0  # the time between the runs is nobody's
    first, second = report["attempts"]
    assert second["new_run"] and second["restored_step"] == 20
    assert report["wall_seconds"] == pytest.approx(
        (first["end"] - first["start"]) + (second["end"] - second["start"])
    )
    _, out, _ = goodput(capsys, url)
    assert "2 runs, 0 restarts, 40 steps (0 wasted)" in out


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    url = str(tmp / "ck")
    train(tmp, url, every_steps=4)
    return url


def test_a_bad_line_is_skipped_with_a_warning(capsys, caplog, one_run, tmp_path):
    import shutil

    url = str(tmp_path / "ck")
    shutil.copytree(one_run, url)
    code, out, _ = goodput(capsys, url, "--json")
    before = json.loads(out)
    store = ub.open_store(url)
    attempt = next(iter(ev.read_log(store)))
    bad = "\n".join(
        [
            '{"kind":"step","t":5.0,"n":1e999,"step":3}',
            "[" * 100_000 + "]" * 100_000,
            '{"kind":"step","t":NaN,"n":900,"step":900}',
            '{"kind":"beat","t":Infinity}',
        ]
    )
    key = ev.object_key(attempt, 0, 999)
    store.write_bytes(key, bad.encode())
    with caplog.at_level("WARNING"):
        code, out, _ = goodput(capsys, url, "--json")
    assert code == 0
    assert json.loads(out) == before  # the bad lines counted for nothing
    [warning] = [r.getMessage() for r in caplog.records if "bad line" in r.getMessage()]
    assert key in warning and "line 1" in warning and "3 more" in warning


def test_plot_names_the_file_it_wrote(capsys, one_run, tmp_path):
    code, out, _ = goodput(capsys, one_run, "--plot", str(tmp_path / "noext"))
    assert code == 0 and (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert out.rstrip().endswith(f"timeline: {tmp_path / 'noext.png'}")
    folder = tmp_path / "plots"
    folder.mkdir()
    code, out, _ = goodput(capsys, one_run, "--plot", str(folder))
    assert code == 0 and (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert out.rstrip().endswith(f"timeline: {folder / 'timeline.png'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noext.png", "plots"]
    code, _, err = goodput(capsys, one_run, "--plot", str(tmp_path / "t.nosuchformat"))
    assert code == 2 and "nosuchformat" in err


@pytest.mark.multiprocess
def test_a_preempted_job_and_its_requeue_are_one_run_with_a_restart(capsys, tmp_path):
    url, staging = str(tmp_path / "ck"), str(tmp_path / "st")
    first = job(tmp_path, url, staging, "--term-at", "15")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 143, out  # saved step 16, closed, exited as SIGTERM asks
    second = job(tmp_path, url, staging)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    code, out, _ = goodput(capsys, url, "--json")
    report = json.loads(out)
    assert code == 0 and report["restarts"] == 1 and report["runs"] == 1
    first_att, second_att = report["attempts"]
    assert first_att["clean"] and second_att["restored_step"] == 16
    assert first_att["preempted"] and not second_att["preempted"]
    assert report["seconds"]["down"] > 0  # the wait for the requeue is the job's time
    code, out, _ = goodput(capsys, url)
    ended = [line.split()[-1] for line in out.splitlines() if line.startswith("20")]
    assert ended == ["preempted", "clean"], out  # it said "clean": the job looked done
