"""Two jobs saving the same steps to one durable URL: at most one is told a step
committed, every committed step holds one writer's bytes, the loser is told who won."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import unbroken as ub
from unbroken.checkpoint.catalog import verify_checkpoint
from unbroken.checkpoint.staging.owner import StagingDirInUseError

JOB = textwrap.dedent(
    """
    import json, sys, torch
    import unbroken as ub
    url, staging, fill, options, go = sys.argv[1:6]
    options = json.loads(options)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {} if staging == "-" else {"staging_dir": staging}
    try:
        mgr = ub.CheckpointManager(
            url, every_steps=1, keep_last=None, storage_options=options, **kw
        )
    except Exception as e:
        open(f"{go}.ready-{fill}", "w").close()
        print(json.dumps({"0": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
    open(f"{go}.ready-{fill}", "w").close()  # made while the other job is made, too
    while not __import__("os").path.exists(go):  # start together
        pass
    told = {}
    for step in range(1, 9):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(fill) * 1000 + step)  # who wrote it, which step
        try:
            mgr.save(step, {"model": model, "optim": opt})
            mgr.wait()
            told[step] = "committed"
        except Exception as e:
            told[step] = f"{type(e).__name__}: {e}"
    try:
        mgr.close()
    except Exception:
        pass
    print(json.dumps(told))
    """
)


def run_two_jobs(tmp_path, url, options, stagings) -> list[dict[int, str]]:
    go = tmp_path / "go"
    told = run_together(
        go,
        [[JOB, url, staging, str(i + 1), json.dumps(options), str(go)]
         for i, staging in enumerate(stagings)],
    )  # fmt: skip
    return [{int(k): v for k, v in t.items()} for t in told]


def run_together(go, argvs: list[list[str]], envs: list[dict] | None = None) -> list[dict]:
    """Run ``python -c *argv`` for each argv, job k (from 1) making ``{go}.ready-k`` when
    set up and starting once ``go`` exists; each one's last line of output, as JSON."""
    base = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=base | (envs[i] if envs else {}),
        )
        for i, argv in enumerate(argvs)
    ]
    # Both managers exist (or were refused) before either job saves: a job that started
    # slowly must not find the other one already finished.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(
        os.path.exists(f"{go}.ready-{i + 1}") for i in range(len(procs))
    ):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    go.write_text("")
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_two_jobs_on_one_url_one_writer_per_step(tmp_path, backend, s3_server_lazy):
    if backend == "local":
        url, options = str(tmp_path / "durable"), {}
    else:
        server = s3_server_lazy.get()
        url, options = f"s3://{server.new_root()}/ckpt", server.storage_options
    told = run_two_jobs(
        tmp_path, url, options, [str(tmp_path / "staging-a"), str(tmp_path / "staging-b")]
    )
    store = ub.open_store(url, **options)
    for step in range(1, 9):
        winners = [i for i, t in enumerate(told) if t[step] == "committed"]
        assert len(winners) <= 1, (step, told)
        for t in told:
            if t[step] != "committed":
                assert "two jobs" in t[step] and "pid" in t[step], t[step]
        committed = store.exists(f"step-{step:012d}/manifest.json")
        if winners:
            assert committed, (step, told)
        if committed:
            # every byte of a committed step is one writer's: its checksums all match
            assert verify_checkpoint(store, step, deep=True) == [], (step, told)
            doc = json.loads(store.read_bytes(f"step-{step:012d}/manifest.json"))
            assert doc["extra"]["writer"]["pid"] > 0


@pytest.mark.multiprocess
def test_two_jobs_sharing_the_default_staging_dir_are_told_so(tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_STAGING_DIR", str(tmp_path / "staging-base"))
    told = run_two_jobs(tmp_path, str(tmp_path / "durable"), {}, ["-", "-"])
    refused = [t[0] for t in told if 0 in t]
    assert len(refused) == 1, told
    assert "StagingDirInUseError" in refused[0] and "in use by pid" in refused[0]
    # one URL: a URL each is the way out (the staging dir follows it), or unbroken.load
    assert "two jobs that save need a url each" in refused[0].lower()
    assert "unbroken.load(url, state)" in refused[0]
    ran = next(t for t in told if 0 not in t)
    assert all(ran[step] == "committed" for step in range(1, 9)), ran


def test_a_live_claim_on_a_staging_dir_is_refused_by_pid(tmp_path):
    from unbroken.checkpoint.staging.owner import claim_staging_dir

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / ".staging.owners"
        folder.mkdir(parents=True)
        (folder / "rank-00000").write_text(json.dumps({"pid": other.pid, "purpose": "job A"}))
        with pytest.raises(StagingDirInUseError, match=f"pid {other.pid}.*job A") as e:
            claim_staging_dir(str(tmp_path / "staging"), 0, "job B")
        # Another URL: its own URL is no help, its own staging_dir is
        assert "with URLs of their own. Give each job its own staging_dir" in str(e.value)
        one_url = r"on one URL .* unbroken\.load\(url, state\).* two jobs that save need a URL each"
        with pytest.raises(StagingDirInUseError, match=one_url):
            claim_staging_dir(str(tmp_path / "staging"), 0, "job A")
    finally:
        other.kill()
        other.wait()
    release = claim_staging_dir(str(tmp_path / "staging"), 0, "job B")  # owner gone
    release()


def test_a_new_manager_of_one_process_on_a_staging_dir_closes_the_older_one_first(
    tmp_path, monkeypatch
):
    """A notebook cell run again (the old manager often out of reach, inside a Trainer's
    callback): the new manager took the staging dir over from the old one, still open
    with its worker, and both tidied the dir's steps."""
    monkeypatch.setenv("UNBROKEN_STAGING_DIR", str(tmp_path / "staging-base"))
    url, model = str(tmp_path / "ck"), torch.nn.Linear(1024, 1024)
    first = ub.CheckpointManager(url)
    first.save(1, {"model": model})  # still in flight
    with pytest.warns(RuntimeWarning, match="still uses staging_dir .*closing it first"):
        again = ub.CheckpointManager(url)  # the default staging dir: the URL's, the same
    with pytest.raises(RuntimeError, match="closed"):
        first.save(2, {"model": model})
    with again:
        assert again.restore({"model": model}) == 1  # the older one's save landed
        again.save(2, {"model": model})
    assert not first._pipeline._thread.is_alive()  # its worker stopped


def test_two_managers_of_one_process_on_two_urls_and_one_staging_dir_are_refused(tmp_path):
    """A model's and its EMA's managers given one staging_dir: the second closed the
    first as if it were a notebook's leftover, whose next save then failed."""
    model, staging = torch.nn.Linear(4, 2), str(tmp_path / "st")
    with ub.CheckpointManager(str(tmp_path / "model"), staging_dir=staging) as first:
        with pytest.raises(StagingDirInUseError, match="need a staging_dir each"):
            ub.CheckpointManager(str(tmp_path / "ema"), staging_dir=staging)
        assert first.save(1, {"model": model})  # untouched


def test_a_claim_this_process_has_not_released_is_refused_not_taken_over(tmp_path):
    """A manager's claim left behind (its close() failed half-way) was taken over by the
    next one of the same process, as a dead process's is."""
    from unbroken.checkpoint.staging.owner import claim_staging_dir

    release = claim_staging_dir(str(tmp_path / "staging"), 0, "job A")
    with pytest.raises(StagingDirInUseError, match="another CheckpointManager of this process"):
        claim_staging_dir(str(tmp_path / "staging"), 0, "job A")
    release()
    claim_staging_dir(str(tmp_path / "staging"), 0, "job A")()  # released: free again


ASYNC_JOB = textwrap.dedent(
    """
    import json, os, sys, time, warnings, torch
    import unbroken as ub
    url, staging, me, other, go = sys.argv[1:6]
    model = torch.nn.Linear(64, 64)
    state = {"model": model}
    mgr = ub.CheckpointManager(url, staging_dir=staging, every_steps=1, keep_last=None)
    mark = lambda what: open(f"{go}.{what}-{me}", "w").close()
    seen = lambda what: os.path.exists(f"{go}.{what}-{other}")
    mark("ready")
    while not os.path.exists(go):  # start together
        time.sleep(0.01)
    raised, warned = None, []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(1, 9):
            mark(f"at-{step}")  # both jobs reach each step before either saves it
            while not (seen(f"at-{step}") or seen("done")):
                time.sleep(0.01)
            try:
                mgr.maybe_save(step, state)  # async: a failure is learnt at a later call
            except Exception as e:
                raised = {"step": step, "type": type(e).__name__, "message": str(e),
                          "this": getattr(e, "this_job", ""), "other": getattr(e, "other_job", "")}
                break
            s = mgr.stats
            while s.committed + s.failed < s.started:  # this save settled (not raised here)
                time.sleep(0.01)
        warned = [str(w.message) for w in record]
    mark("done")
    while not seen("done"):  # alive while the other job saves: it must find this one live
        time.sleep(0.01)
    try:
        mgr.close()
    except Exception:
        pass
    print(json.dumps({"pid": os.getpid(), "raised": raised, "warned": warned}))
    """
)


@pytest.mark.multiprocess
def test_a_second_job_on_one_url_is_raised_from_maybe_save_naming_both(tmp_path):
    """Two live jobs with their own job ids on one URL never heal: the job that learns
    of the other raises OtherJobError from maybe_save (raise_on_failure is off), naming
    both, instead of training on with every save failing and warned about."""
    go, url = tmp_path / "go", str(tmp_path / "durable")
    told = run_together(
        go,
        [[ASYNC_JOB, url, str(tmp_path / f"st-{i}"), str(i), str(3 - i), str(go)] for i in (1, 2)],
        [{"UNBROKEN_JOB_ID": f"job-{i}"} for i in (1, 2)],
    )
    told = dict(zip((1, 2), told))
    raised = [(i, t["raised"]) for i, t in told.items() if t["raised"]]
    assert raised, told
    for i, r in raised:
        assert r["type"] == "OtherJobError", r
        mine, theirs = told[i]["pid"], told[3 - i]["pid"]
        assert f"'job-{i}'" in r["this"] and f"pid {mine}" in r["this"], r
        assert f"'job-{3 - i}'" in r["other"] and f"pid {theirs}" in r["other"], r
        assert r["this"] in r["message"] and r["other"] in r["message"], r
        assert not [w for w in told[i]["warned"] if "OtherJobError" in w or "alive" in w], r
    store = ub.open_store(url)
    for step in range(1, 9):
        if store.exists(f"step-{step:012d}/manifest.json"):
            assert verify_checkpoint(store, step, deep=True) == [], (step, told)


_COMMIT_AND_STAY = """
import sys, time, torch, unbroken as ub
mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], memory_tier=False)
mgr.save(10, {"w": torch.zeros(4)})
mgr.wait()
print("COMMITTED", flush=True)
time.sleep(120)
"""


def test_a_job_behind_a_live_jobs_newer_step_is_told_two_jobs_share_the_url(tmp_path):
    """A job that restored, then met the newer step of another job alive on this host,
    was told StepBehindError's 'call restore(state)'."""
    url = str(tmp_path / "durable")
    other = subprocess.Popen(
        [sys.executable, "-c", _COMMIT_AND_STAY, url, str(tmp_path / "st-a")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, UNBROKEN_JOB_ID="job-a"),
    )  # fmt: skip
    try:
        assert other.stdout.readline().strip() == "COMMITTED"
        mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "st-b", memory_tier=False)
        mgr.save(5, {"w": torch.ones(4)})
        with pytest.raises(ub.OtherJobError, match=r"step 10 was committed by .* alive"):
            mgr.wait()
        mgr.close()
    finally:
        other.kill()
        other.wait()
    mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "st-b", memory_tier=False)
    mgr.save(5, {"w": torch.ones(4)})  # that job is gone: an earlier run's step
    with pytest.raises(ub.StepBehindError, match="call restore"):
        mgr.wait()
    mgr.close()
