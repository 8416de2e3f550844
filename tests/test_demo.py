"""End to end: `unbroken demo`, small. Ranks SIGKILLed at random moments under
``torchrun --max-restarts`` resume by themselves, and the run ends bitwise equal to one
without failures (data order, augmentations, dropout, weights, optimizer state). Its
story holds together: attempts numbered as on the timeline, kill moments on the
timeline's axis, each lost stretch explained by the newest commit at the kill, the
goodput beside the reference's, and the checkpoints kept for the commands it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from unbroken import open_store
from unbroken.goodput.breakdown import job_breakdown
from unbroken.goodput.events import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL = re.compile(
    r"killed a rank of attempt (\d+) \(SIGKILL, pid \d+\) at step (\d+): "
    r"(?:it resumes from step (\d+)|no checkpoint had committed yet)"
)
RESUMED = re.compile(r"crashed: attempt (\d+) resumed by itself at step (\d+)")
SUMMARY = re.compile(r"attempt (\d+) killed at ([\d.]+) s \(the timeline's axis\), step (\d+)")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TMPDIR=str(tmp))
    plot = tmp / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli.main", "demo", "--steps", "40", "--kills", "2",
         "--files", "256", "--every-steps", "10", "--seed", "3", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, out.stderr, plot


@pytest.mark.multiprocess
def test_unbroken_demo_crashes_resumes_and_ends_bitwise_equal(demo):
    out, err, plot = demo
    assert "bitwise equal to the reference: yes" in out, out
    assert re.search(r"2 kills of a random rank of 2, 2 restarts", out), out
    assert "goodput" in out and "wasted" in out
    assert plot.stat().st_size > 0
    assert "Traceback" not in out + err


@pytest.mark.multiprocess
def test_each_kill_is_explained_and_numbered_as_the_timeline_numbers_it(demo):
    out, _, _ = demo
    kills, resumed = KILL.findall(out), RESUMED.findall(out)
    summary = SUMMARY.findall(out)
    assert len(kills) == len(resumed) == len(summary) == 2, out
    for (attempt, step, committed), (next_attempt, at), (lane, _, step_again) in zip(
        kills, resumed, summary
    ):
        assert int(next_attempt) == int(attempt) + 1  # the restart after this kill
        assert int(at) == int(committed or 0), out  # it resumed where the kill line said
        assert (lane, step_again) == (attempt, step), out  # the timeline's lane, live numbers


@pytest.mark.multiprocess
def test_kill_moments_lie_on_the_timeline_in_the_killed_attempts_lane(demo):
    out, _, _ = demo
    where = re.search(r"unbroken ls (\S+)", out)
    assert where, out
    b = job_breakdown(read_log(open_store(where[1])), 0)
    t0 = b.attempts[0].start
    starts = [a.start - t0 for a in b.attempts] + [float("inf")]
    for lane, at, _ in SUMMARY.findall(out):
        i = int(lane) - 1
        assert starts[i] <= float(at) < starts[i + 1], (lane, at, starts)


@pytest.mark.multiprocess
def test_the_checkpoints_are_kept_for_the_commands_it_prints_and_goodput_has_its_reference(
    demo,
):
    out, _, _ = demo
    assert re.search(r"without failures \(the reference run\): goodput [\d.]+%", out), out
    where = re.search(r"unbroken ls (\S+)", out)[1]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    ls = subprocess.run(
        [sys.executable, "-m", "unbroken.cli.main", "ls", where],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert ls.returncode == 0 and "40" in ls.stdout, ls.stdout + ls.stderr
