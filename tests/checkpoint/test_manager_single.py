"""CheckpointManager in one process (no process group): round trips, cadence, errors."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken as ub
from tests.link_names import private_link
from unbroken._util.procs import process_start_ticks
from unbroken.checkpoint.catalog import verify_checkpoint
from unbroken.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    SaveFailedError,
    raise_if_interrupted,
)
from unbroken.checkpoint.format.manifest import step_dir
from unbroken.checkpoint.format.writers import WRITER_NAME, writer_identity
from unbroken.storage.base import TEMP_MARKER, temp_name

from .manager_util import (
    assert_same,
    flip_payload_byte,
    host_rss,
    make_state,
    plant_value,
    rng_draws,
    snapshot,
    train,
)

FAST_RETRY = ub.RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01)


def manager(tmp_path: Path, url: str | None = None, **kw) -> ub.CheckpointManager:
    """A manager whose node copy is on disk (the tests here look at its files); the memory
    tier's own tests are in test_memory_tier.py."""
    kw.setdefault("every_steps", 2)
    kw.setdefault("memory_tier", False)
    return ub.CheckpointManager(
        url or str(tmp_path / "durable"), staging_dir=str(tmp_path / "staging"), **kw
    )


def train_and_save(mgr: ub.CheckpointManager, state: dict, steps) -> dict[int, dict]:
    """Train one step and save it until committed, for each of ``steps``; what each saved."""
    saved = {}
    for step in steps:
        train(state, [step])
        mgr.save(step, state)
        mgr.wait()
        saved[step] = snapshot(state)
    return saved


@pytest.mark.parametrize("tier", ["memory", "staging", "durable"])
def test_round_trip_every_kind_of_value_and_rng(tmp_path, tier):
    state = make_state(0)
    with manager(tmp_path, memory_tier=None if tier == "memory" else False) as mgr:
        assert mgr.restore(state) is None
        train(state, range(1, 5))
        state["meta"] = {"name": "run-7", "tags": [3]}
        assert mgr.save(4, state)
        mgr.wait()
        expected, draws = snapshot(state), rng_draws()
        train(state, range(5, 7))  # moves on after the save
        if tier == "durable":
            import shutil

            shutil.rmtree(mgr.staging_dir)
        fresh = make_state(1, lr=0.9)
        assert mgr.restore(fresh) == 4
        assert mgr.last_restore.tier == tier
        assert_same(snapshot(fresh), expected)
        assert rng_draws() == draws
        assert mgr.stats.committed == 1 and mgr.stats.failed == 0


def test_maybe_save_cadence_and_retention(tmp_path):
    state = make_state()
    for step in (1, 3, 99):  # abandoned partial saves of an earlier run, older and newer
        partial = tmp_path / "durable" / step_dir(step)
        partial.mkdir(parents=True)
        # step 3's writer was killed mid-upload: a temp file is all it left
        name = temp_name("__0_0.distcp") if step == 3 else "__0_0.distcp"
        (partial / name).write_bytes(b"half")
        (tmp_path / "staging" / step_dir(step)).mkdir(parents=True)
    with manager(tmp_path, every_steps=2, keep_last=2, keep_every_steps=4, when_busy="wait") as mgr:
        for step in range(0, 11):
            train(state, [step])
            mgr.maybe_save(step, state)
    infos = mgr.checkpoints()  # after close(): retention has run
    assert [c.step for c in infos if c.committed] == [4, 8, 10]
    assert [c.step for c in infos if not c.committed] == [99]  # newer: maybe in flight
    steps_present = sorted(n for n in os.listdir(tmp_path / "durable") if n != "_goodput")
    assert steps_present == [step_dir(s) for s in (4, 8, 10, 99)], (
        "an abandoned partial step older than the newest commit is left"
    )
    # The staging tier: the newest committed copy only. A partial local copy is no one's
    # upload in flight (this job agreed on every save it wrote), so the newer one goes too.
    staged = sorted(os.listdir(tmp_path / "staging"))
    assert staged == [step_dir(10)], staged


def test_retention_leaves_a_partial_step_that_another_live_job_claims(tmp_path):
    """Another job on the URL may be uploading an older step and commit it a moment
    later: retention removes a partial step only when its claim is stale or this job's."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_ticks = process_start_ticks(gone.pid)
    gone.wait()
    try:
        me = writer_identity()
        claims = {
            1: dict(me, pid=alive.pid, ticks=process_start_ticks(alive.pid), job="other"),
            3: dict(me, pid=gone.pid, ticks=gone_ticks, job="other"),
        }
        for step, claim in claims.items():
            partial = tmp_path / "durable" / step_dir(step)
            partial.mkdir(parents=True)
            (partial / "__0_0.distcp").write_bytes(b"half")
            (partial / WRITER_NAME).write_text(json.dumps(claim))
        state = make_state()
        with manager(tmp_path, keep_last=1) as mgr:
            assert mgr.save(4, state)
            mgr.wait()
        present = sorted(n for n in os.listdir(tmp_path / "durable") if n != "_goodput")
        assert present == [step_dir(1), step_dir(4)], (
            "a live job's step went, or a dead one's stayed"
        )
        assert (tmp_path / "durable" / step_dir(1) / "__0_0.distcp").read_bytes() == b"half"
    finally:
        alive.kill()
        alive.wait()


def test_a_committed_step_is_never_saved_again(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        assert mgr.save(2, state)
        mgr.wait()
        assert not mgr.save(2, state)
        assert mgr.stats.skipped_committed == 1
    # A new manager (a restarted job) that did not restore: the pipeline refuses.
    before = (tmp_path / "durable" / step_dir(2) / "manifest.json").read_bytes()
    with pytest.raises(SaveFailedError, match="already committed"), manager(tmp_path) as mgr2:
        mgr2.save(2, state)
    assert (tmp_path / "durable" / step_dir(2) / "manifest.json").read_bytes() == before


def test_background_failure_surfaces_and_commits_nothing(tmp_path):
    switch = tmp_path / "outage"
    opts = {"latency": 0, "bandwidth": None, "outage_file": str(switch)}
    url = "emulated::" + str(tmp_path / "durable")
    state = make_state()
    mgr = manager(tmp_path, url=url, storage_options=opts, retry=FAST_RETRY)
    assert mgr.save(2, state)
    mgr.wait()
    switch.write_text("down")
    assert mgr.save(4, state)  # fails in the background: the remote is down
    with pytest.warns(RuntimeWarning, match="step 4 failed"):
        mgr._pipeline.wait()  # let the failure happen, without reporting it
        assert not mgr.maybe_save(5, state)  # reported here, training goes on
    switch.unlink()
    assert mgr.stats.failed == 1 and [e.step for e in mgr.failures] == [4]
    assert [c.step for c in mgr.checkpoints() if c.committed] == [2]
    assert not (tmp_path / "durable" / step_dir(4) / "manifest.json").exists()
    switch.write_text("down")
    mgr.save(6, state)
    with pytest.raises(SaveFailedError, match="step 6") as info:
        mgr.close()
    assert "outage" in str(info.value)
    fresh = make_state(3)
    switch.unlink()
    with manager(tmp_path, url=url, storage_options=opts) as again:
        assert again.restore(fresh) == 2


def test_a_save_that_fails_before_submit_returns_is_tried_again_at_the_same_step(tmp_path):
    """The pipeline may fail a job before the training thread is back from handing it
    over (descheduled there): the step must still count as not saved."""
    mgr, switch = outage_manager(tmp_path)
    state = make_state()
    handed = mgr._pipeline.submit

    def submit_then_wait_for_the_end(job) -> None:
        handed(job)
        job.done.wait()

    mgr._pipeline.submit = submit_then_wait_for_the_end
    switch.write_text("down")
    with pytest.warns(RuntimeWarning, match="step 6 failed"):
        assert mgr.save(6, state)
        mgr._report_failures(raising=False)
    switch.unlink()
    mgr._pipeline.submit = handed
    assert mgr.save(6, state), "the failed step was taken for saved"
    mgr.close()
    assert mgr.stats.skipped_committed == 0
    assert [c.step for c in mgr.checkpoints() if c.committed] == [6]


def test_raise_on_failure_stops_training(tmp_path):
    mgr, switch = outage_manager(tmp_path, raise_on_failure=True)
    switch.write_text("down")
    state = make_state()
    mgr.save(2, state)
    mgr._pipeline.wait()
    with pytest.raises(SaveFailedError, match="step 2"):
        mgr.maybe_save(3, state)
    mgr.close()  # raised already: not again


def test_a_full_staging_disk_is_named_as_such(tmp_path, small_tmpfs):
    """The write's own OSError, not a BufferError from freeing its bounce buffer while the
    error's traceback still held a view of it."""
    mgr = ub.CheckpointManager(
        str(tmp_path / "durable"), staging_dir=str(small_tmpfs / "staging"), memory_tier=False
    )
    try:
        with open(small_tmpfs / "hog", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:  # another program takes all the space
                f.write(b"\0" * (1 << 16))
        mgr.save(1, {"model": nn.Linear(1024, 1536)})  # 6 MB
        with pytest.raises(SaveFailedError, match="No space left on device"):
            mgr.wait()
    finally:
        mgr.close()


def test_a_staging_disk_with_room_for_one_copy_drops_the_committed_one_for_the_next(
    tmp_path, small_tmpfs, caplog
):
    """Every save after the first failed with ENOSPC for the rest of the run: the only
    thing on the disk was this node's copy of a step the durable tier holds."""
    model = nn.Linear(2048, 2048)  # 16 MiB: two copies cannot fit in 24
    subprocess.run(["mount", "-o", "remount,size=24m", str(small_tmpfs)], check=True)
    with ub.CheckpointManager(
        str(tmp_path / "durable"), staging_dir=str(small_tmpfs / "st"), memory_tier=False
    ) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, {"model": model})
            mgr.wait()
        assert [c.step for c in mgr.checkpoints() if c.committed] == [1, 2, 3]
    assert "dropped that copy" in caplog.text
    fresh = nn.Linear(2048, 2048)
    with ub.CheckpointManager(str(tmp_path / "durable"), staging_dir=str(tmp_path / "st2")) as m:
        assert m.restore({"model": fresh}) == 3
    assert torch.equal(fresh.weight, model.weight)


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    state = make_state()
    with manager(tmp_path, keep_last=3, when_busy="wait") as mgr:
        train(state, range(1, 3))
        mgr.save(2, state)
        mgr.wait()
        expected = snapshot(state)
        train(state, range(3, 5))
        mgr.save(4, state)
        mgr.wait()
    # Flip one byte in the newest checkpoint, in both tiers.
    for tier in ("durable", "staging"):
        flip_payload_byte(tmp_path / tier / step_dir(4))
    fresh = make_state(5)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning, match="falling back"):
        assert mgr.restore(fresh) == 2
    assert_same(snapshot(fresh), expected)
    # Retrained up to the damaged step, the run may not save over it: every restart would
    # end here, so the refusal says what happened and what to do (not "two jobs?").
    mgr = manager(tmp_path)
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert mgr.restore(make_state(5)) == 2
    assert mgr.save(3, fresh)
    try:
        with pytest.raises(SaveFailedError) as err:
            mgr.save(4, fresh)
            mgr.wait()
    finally:
        with contextlib.suppress(SaveFailedError):
            mgr.close()
    message = str(err.value)
    assert "this run's restore found it unusable" in message and "--step 4" in message
    assert "two jobs" not in message


def test_corrupt_local_copy_reads_durable_same_step(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        train(state, range(1, 3))
        mgr.save(2, state)
        mgr.wait()
        expected = snapshot(state)
    flip_payload_byte(tmp_path / "staging" / step_dir(2), "optim.state.0.weight.exp_avg")
    fresh = make_state(5)
    # named as the node's copies (it named the memory tier's folder for a replica's file)
    said = rf"{step_dir(2)} on this node's copies \(staging\) is not usable: .*staging"
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning, match=said):
        assert mgr.restore(fresh) == 2
    assert_same(snapshot(fresh), expected)


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_local_copy_missing_a_file_reads_that_file_from_the_durable_tier(tmp_path, damage):
    """What a node holds of a step is read locally and the rest from the durable tier (on
    several nodes, each node's staging tier holds only its own ranks' files)."""
    state = make_state()
    with manager(tmp_path) as mgr:
        train(state, range(1, 3))
        mgr.save(2, state)
        mgr.wait()
        expected, draws = snapshot(state), rng_draws()
    shard = tmp_path / "staging" / step_dir(2) / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size - 1)
    fresh = make_state(5)
    with manager(tmp_path) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing wrong to warn of
        assert mgr.restore(fresh) == 2
        assert mgr.last_restore.tier == "staging+durable"
    assert_same(snapshot(fresh), expected)
    assert rng_draws() == draws
    # Without the local manifest nothing local is trusted: all from the durable tier.
    (tmp_path / "staging" / step_dir(2) / "manifest.json").unlink()
    with manager(tmp_path) as mgr:
        assert mgr.restore(make_state(6)) == 2
        assert mgr.last_restore.tier == "durable"
        assert mgr.last_restore.url.startswith(str(tmp_path / "durable"))


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_a_bad_durable_file_met_in_the_staging_attempt_is_not_read_again(tmp_path, damage):
    """The staging attempt reads what the node lacks from the durable tier. When that copy
    is bad, the warning names the durable tier, and restore falls back to the previous
    commit at once instead of reading the same bad bytes again in a durable attempt."""
    state = make_state()
    with manager(tmp_path, keep_last=3) as mgr:
        expected = train_and_save(mgr, state, (2, 4))[2]
    shard = step_dir(4) + "/__0_0.distcp"
    (tmp_path / "staging" / shard).unlink()
    if damage == "flipped":
        flip_payload_byte(tmp_path / "durable" / step_dir(4))
    else:
        (tmp_path / "durable" / shard).unlink()
    fresh = make_state(5)
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore(fresh) == 2
    unusable = [str(w.message) for w in caught if "is not usable" in str(w.message)]
    assert len(unusable) == 1, unusable
    assert unusable[0].startswith(f"checkpoint {tmp_path / 'durable' / step_dir(4)} is not")
    assert "__0_0.distcp" in unusable[0]
    assert any("falling back" in str(w.message) for w in caught)
    assert_same(snapshot(fresh), expected)


def test_a_run_restored_at_an_older_step_refuses_to_save_among_the_newer_ones(tmp_path, caplog):
    """restore(step=2) where 4 is committed: saves into that URL would mix the two runs
    (4 stays the newest, so a restart loads it), so they are refused, by name; the run
    goes on into another URL, as the error says."""
    state = make_state()
    with manager(tmp_path, keep_last=5) as mgr:
        saved = train_and_save(mgr, state, (2, 4))
    with manager(tmp_path, keep_last=5) as mgr:
        with caplog.at_level("WARNING", logger="unbroken.checkpoint.manager"):
            assert mgr.restore(state, step=2) == 2
        assert "restored step 2 of " in caplog.text and "steps 4 are committed" in caplog.text
        train(state, [3])
        for save in (mgr.save, mgr.maybe_save):  # maybe_save at once, not at a due step
            with pytest.raises(ub.OlderStepRestoredError, match="restart would load step 4"):
                save(3, state)
        err = pickle.loads(pickle.dumps(ub.OlderStepRestoredError(str(tmp_path), 2, [4])))
        assert (err.step, err.newer) == (2, [4]) and "steps 4 are committed" in str(err)
        branched = snapshot(state)
    assert [c.step for c in ub.CheckpointManager(str(tmp_path / "durable")).checkpoints()] == [2, 4]
    with manager(tmp_path, url=str(tmp_path / "branch")) as mgr:
        mgr.save(3, state)
    fresh = make_state(9)
    with manager(tmp_path, url=str(tmp_path / "branch")) as mgr:
        assert mgr.restore(fresh) == 3
    assert_same(snapshot(fresh), branched)
    with manager(tmp_path, keep_last=5) as mgr:  # the first run's newest is untouched
        assert mgr.restore(fresh, step=2) == 2
        assert mgr.restore(fresh, step=4) == 4  # the newest again: saves are fine
        assert_same(snapshot(fresh), saved[4])
        caplog.clear()
        train(fresh, [5])
        mgr.save(6, fresh)
    assert "committed too" not in caplog.text


def test_every_copy_corrupt_raises(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(2, state)
        mgr.wait()
    for tier in ("durable", "staging"):
        flip_payload_byte(tmp_path / tier / step_dir(2), "model.3.bias")
    with manager(tmp_path) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ub.checkpoint.errors.CheckpointCorruptError, match="could be loaded"):
            mgr.restore(make_state(1))


class Evil:
    """Pickles to a call that would create a marker file if anyone unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvilStateful:
    def __init__(self, value) -> None:
        self.value = {"evil": value}

    def state_dict(self):
        return self.value

    def load_state_dict(self, sd):
        self.value = sd


def test_planted_pickle_is_never_executed(tmp_path):
    """An attacker rewrites a committed step: a plain value becomes a malicious pickle,
    with every size and checksum fixed up to match."""
    import io
    import shutil

    marker = tmp_path / "pwned"
    with manager(tmp_path) as mgr:
        mgr.save(2, {"model": nn.Linear(2, 2), "thing": EvilStateful(0)})
        mgr.wait()
    shutil.rmtree(tmp_path / "staging")
    hostile = io.BytesIO()
    torch.save(Evil(str(marker)), hostile)
    plant_value(tmp_path / "durable" / step_dir(2), "thing.evil", hostile.getvalue())
    assert verify_checkpoint(ub.open_store(str(tmp_path / "durable")), 2, deep=True) == []
    with manager(tmp_path) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ub.checkpoint.errors.CheckpointError, match=r"thing\.evil"):
            mgr.restore({"model": nn.Linear(2, 2), "thing": EvilStateful(0)})
    assert not marker.exists()


class Refusing(EvilStateful):
    def load_state_dict(self, sd):
        raise ValueError("this loader's files are not the checkpoint's")


def test_an_entry_that_refuses_its_state_is_named_and_nothing_is_loaded(tmp_path):
    """A LoaderStateError said what was wrong with the files, not which entry of the state
    raised it: the advice (leave that entry out) needs its name."""
    model = nn.Linear(2, 2)
    with manager(tmp_path) as mgr:
        mgr.save(2, {"model": model, "feed": EvilStateful(1)})
        mgr.wait()
    fresh = nn.Linear(2, 2)
    before = fresh.weight.detach().clone()
    with manager(tmp_path) as mgr, pytest.raises(ValueError, match="not the checkpoint") as err:
        mgr.restore({"model": fresh, "feed": Refusing(0)})
    assert any("'feed'" in note for note in getattr(err.value, "__notes__", [])), err.value
    assert torch.equal(fresh.weight, before)  # refused before any weight was loaded


def test_another_model_is_a_mismatch_naming_keys(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(2, {"model": nn.Linear(4, 3), "epoch": 1})
        mgr.wait()
    other = {"model": nn.Sequential(nn.Linear(4, 5)), "epoch": 0}
    with manager(tmp_path) as mgr, pytest.raises(CheckpointMismatchError) as info:
        mgr.restore(other)
    msg = str(info.value)
    assert "model.0.weight" in msg and "model.weight" in msg
    wrong_shape = {"model": nn.Linear(4, 7), "epoch": 0}
    with manager(tmp_path) as mgr, pytest.raises(CheckpointMismatchError, match=r"\(3, 4\)"):
        mgr.restore(wrong_shape)
    assert other["epoch"] == 0  # nothing was replaced


def test_s3_durable_tier(tmp_path, s3_server):
    url = f"s3://{s3_server.new_root()}/run/ckpt"
    state = make_state()
    with manager(tmp_path, url=url, storage_options=s3_server.storage_options) as mgr:
        train(state, range(1, 3))
        mgr.save(2, state)
        mgr.wait()
        expected = snapshot(state)
        import shutil

        shutil.rmtree(mgr.staging_dir)
        fresh = make_state(9)
        assert mgr.restore(fresh) == 2
        # the native backend sends the shards from the host buffers, not the staged file
        assert mgr.stats.bytes_from_memory > 0
    assert_same(snapshot(fresh), expected)
    store = ub.open_store(url, **s3_server.storage_options)
    doc = json.loads(store.read_bytes(f"{step_dir(2)}/manifest.json"))
    assert doc["step"] == 2 and doc["world_size"] == 1


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="inside the durable"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "d" / "s")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="every_steps"):
            ub.CheckpointManager(tmp_path / "d", every_steps=bad)
    with manager(tmp_path) as mgr:
        with pytest.raises(TypeError, match="'gen'"):
            mgr.save(2, {"gen": object()})
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
        with pytest.raises(ValueError, match="no module in the state owns"):
            mgr.save(2, {"optim": opt})
        model, scale = nn.Linear(2, 2), torch.zeros(1, requires_grad=True)  # CLIP's scale
        opt = torch.optim.SGD([*model.parameters(), scale], lr=1)
        with pytest.raises(ValueError, match="1 of the optimizer's parameters belong to no"):
            mgr.save(2, {"model": model, "scale": scale, "optim": opt})
        with pytest.raises(ValueError, match="non-negative"):
            mgr.save(-1, {"x": 1})
        for bad in ("4", 4.0, True, -2):
            with pytest.raises(ValueError, match="non-negative int"):
                mgr.maybe_save(bad, {"x": 1})
            with pytest.raises(ValueError, match="non-negative int"):
                mgr.restore({"x": 1}, step=bad)
        assert mgr.checkpoints() == []


def test_every_seconds_cadence(tmp_path):
    state = make_state()
    with manager(tmp_path, every_steps=None, every_seconds=0.2, when_busy="wait") as mgr:
        assert not mgr.maybe_save(1, state)  # 0.2 s have not passed since the manager began
        import time

        time.sleep(0.25)
        assert mgr.maybe_save(2, state)
        assert not mgr.maybe_save(3, state)
        mgr.wait()
    assert [c.step for c in mgr.checkpoints()] == [2]


def test_unreachable_durable_store_is_named(tmp_path):
    from .distributed import free_port

    opts = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    state = make_state()
    mgr = manager(tmp_path, url="s3://nowhere/ckpt", storage_options=opts, retry=FAST_RETRY)
    with pytest.raises(ub.StoreError, match="s3://nowhere/ckpt"):
        mgr.restore(state)
    mgr.save(2, state)
    with pytest.raises(SaveFailedError, match="step 2") as info:
        mgr.close()
    assert "s3://nowhere/ckpt" in str(info.value)


DISK_FULL = """
import resource, signal, sys, torch
sys.path.insert(0, {root!r})
import unbroken as ub
from unbroken.checkpoint.errors import SaveFailedError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
mgr = ub.CheckpointManager({durable!r}, staging_dir={staging!r})
state = {{"big": torch.ones(1_000_000)}}
mgr.save(1, state)
mgr.wait()  # staging buffers exist now (they are reused)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # a nearly full disk
try:
    mgr.save(2, state)
    mgr.close()
except SaveFailedError as e:
    print("FAILED:", e)
print("committed:", [c.step for c in mgr.checkpoints() if c.committed])
"""


def test_staging_disk_full_is_a_clear_failure(tmp_path):
    import subprocess
    import sys

    from .distributed import ROOT, rank_env

    script = DISK_FULL.format(
        root=str(ROOT / "src"), durable=str(tmp_path / "d"), staging=str(tmp_path / "s")
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "FAILED: checkpoint save of step 2 failed" in out, out
    assert "local staging tier" in out and "File too large" in out, out
    assert "committed: [1]" in out, out


def test_a_clean_end_leaves_nothing_in_the_default_staging_place(tmp_path, monkeypatch):
    """Every URL a clean run saved to left two empty folders in /tmp for good (a
    notebook's or a test suite's runs piled up a thousand)."""
    base = tmp_path / "stage-base"
    monkeypatch.setenv("UNBROKEN_STAGING_DIR", str(base))
    for run in range(2):  # the second run finds nothing of the first, and saves as well
        with ub.CheckpointManager(str(tmp_path / "durable" / str(run))) as mgr:
            assert mgr.save(1, make_state())
        assert list(base.iterdir()) == [], sorted(p.name for p in base.iterdir())
    with ub.CheckpointManager(str(tmp_path / "durable" / "0")) as mgr:  # a resume
        assert mgr.restore(make_state()) == 1
        assert mgr.save(2, make_state())


def test_reused_staging_dir_with_a_stale_local_copy(tmp_path):
    state = {"w": torch.ones(10)}
    with manager(tmp_path, url=str(tmp_path / "run1")) as mgr:
        mgr.save(2, state)
        mgr.wait()
    state["w"].fill_(2.0)
    with manager(tmp_path, url=str(tmp_path / "run2")) as mgr:  # same staging_dir
        mgr.save(2, state)
        mgr.wait()
        fresh = {"w": torch.zeros(10)}
        assert mgr.restore(fresh) == 2
    assert torch.equal(fresh["w"], torch.full((10,), 2.0))


def test_in_place_change_during_the_copy_never_commits_mixed_values(tmp_path):
    """Either the save is abandoned (torn) and reported, or it holds the values at save()."""
    big = torch.zeros(16_000_000)  # 64 MB: the background copy takes a while
    state = {"big": big, "small": torch.zeros(3)}
    mgr = manager(tmp_path)
    mgr.save(2, state)
    big.add_(1.0)  # not through an optimizer: nothing makes this wait for the copy
    try:
        mgr.close()
        committed = True
    except SaveFailedError as e:
        assert "torn" in str(e).lower() or "changed" in str(e).lower(), e
        committed = False
    steps = [c.step for c in mgr.checkpoints() if c.committed]
    assert steps == ([2] if committed else [])
    if committed:
        fresh = {"big": torch.full((16_000_000,), 7.0), "small": torch.ones(3)}
        with manager(tmp_path) as again:
            assert again.restore(fresh) == 2
        assert torch.all(fresh["big"] == 0.0)


@pytest.fixture
def immutable(tmp_path):
    """Make a directory refuse writes even to root (chattr +i); undone after the test."""
    import shutil
    import subprocess

    made: list[Path] = []
    probe = tmp_path / "probe"
    probe.mkdir()
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(probe)]).returncode:
        pytest.skip("chattr +i is not available here")
    subprocess.run(["chattr", "-i", str(probe)], check=True)

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["chattr", "+i", str(path)], check=True)
        made.append(path)
        return path

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_permission_denied_on_the_durable_tier_is_named(tmp_path, immutable):
    durable = immutable(tmp_path / "durable")
    with manager(tmp_path, url=str(durable)) as mgr:
        assert mgr.restore(make_state()) is None  # reading an empty durable tier is fine
        mgr.save(2, make_state())
        with pytest.raises(SaveFailedError, match="step 2") as info:
            mgr.wait()
    assert "permission denied" in str(info.value) and str(durable) in str(info.value)
    assert list(durable.iterdir()) == []


def test_synchronous_saves_are_committed_on_return(tmp_path):
    state = make_state()
    with manager(tmp_path, async_save=False) as mgr:
        for step in range(1, 7):
            train(state, [step])
            mgr.maybe_save(step, state)
            due = [s for s in (2, 4, 6) if s <= step]
            assert [c.step for c in mgr.checkpoints() if c.committed] == due[-3:]
        assert mgr.stats.committed == 3 and mgr.stats.skipped_busy == 0


def test_a_commit_record_without_its_files_is_skipped(tmp_path):
    import shutil

    state = make_state()
    with manager(tmp_path, when_busy="wait") as mgr:
        mgr.save(2, state)
        mgr.wait()
        expected = snapshot(state)
        train(state, range(3, 5))
        mgr.save(4, state)
    shutil.rmtree(tmp_path / "staging")
    (tmp_path / "durable" / step_dir(4) / "__0_0.distcp").unlink()
    fresh = make_state(7)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning, match="incomplete"):
        assert mgr.restore(fresh) == 2
    assert_same(snapshot(fresh), expected)


def test_durable_copy_loads_with_vanilla_dcp(tmp_path):
    """Interop: plain dcp.load with FileSystemReader finds the manager's keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = make_state()
    train(state, range(1, 3))
    with manager(tmp_path) as mgr:
        mgr.save(2, state)
    fresh = make_state(4)
    model, optim = fresh["model"], fresh["optim"]
    sd = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "ema": fresh["ema"],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "durable" / step_dir(2)))
    for k, v in state["model"].state_dict().items():
        assert torch.equal(sd["model"][k], v), k
    assert torch.equal(sd["ema"], state["ema"])


def test_next_save_stages_while_the_previous_one_uploads(tmp_path):
    """Host buffers are free once a save is written locally; its upload runs on."""
    import time

    opts = {"latency": 0, "bandwidth": "1MB", "link": private_link("slow")}
    state = {"w": torch.zeros(500_000), "step": 0}  # 2 MB: ~2 s on the emulated link
    mgr = manager(tmp_path, url="emulated::" + str(tmp_path / "durable"), storage_options=opts)
    mgr.save(2, state)
    first = mgr._pipeline.in_flight
    while mgr._stager.busy:  # until step 2 is in the local tier
        time.sleep(0.01)
    state["w"].fill_(4.0)
    state["step"] = 4
    assert mgr.save(4, state)
    assert not first.done.is_set(), "step 2 should still be uploading"
    assert mgr.stats.waited_busy == 0
    mgr.close()
    assert [c.step for c in mgr.checkpoints() if c.committed] == [2, 4]
    fresh = {"w": torch.ones(500_000), "step": -1}
    with manager(
        tmp_path, url="emulated::" + str(tmp_path / "durable"), storage_options=opts
    ) as again:
        assert again.restore(fresh) == 4
    assert torch.all(fresh["w"] == 4.0) and fresh["step"] == 4


def test_a_durable_tier_that_is_down_does_not_keep_the_next_save_from_staging(tmp_path):
    """Uploads borrow the staging buffers for their first attempt only: while the store
    retries, the buffers are free and the next save can take them."""
    import time

    from unbroken.storage import RetryPolicy

    switch = tmp_path / "outage"
    opts = {"latency": 0, "bandwidth": None, "outage_file": str(switch)}
    slow_retry = RetryPolicy(max_attempts=1000, base_delay=0.05, max_delay=0.05, deadline=600)
    url = "emulated::" + str(tmp_path / "durable")
    state = {"w": torch.zeros(300_000), "step": 0}
    mgr = manager(tmp_path, url=url, storage_options=opts, retry=slow_retry)
    mgr.save(2, state)
    mgr.wait()
    sent = mgr.stats.bytes_from_memory
    assert sent > 0  # the store was up: the upload went from the buffers
    switch.write_text("down")
    state["step"] = 4
    mgr.save(4, state)
    uploading = mgr._pipeline.in_flight
    while mgr._stager.busy:  # written locally, its upload's first attempt refused
        time.sleep(0.01)
    assert not uploading.done.is_set(), "step 4 should still be retrying its upload"
    state["w"].fill_(6.0)
    state["step"] = 6
    assert mgr.maybe_save(6, state)  # staged beside the retrying upload, not skipped
    switch.unlink()
    mgr.close()
    assert [c.step for c in mgr.checkpoints() if c.committed] == [2, 4, 6]
    assert mgr.stats.skipped_busy == 0 and mgr.stats.waited_busy == 0
    fresh = {"w": torch.ones(300_000), "step": -1}
    with manager(tmp_path, url=url, storage_options=opts) as again:
        assert again.restore(fresh) == 6
    assert torch.all(fresh["w"] == 6.0) and fresh["step"] == 6


def test_background_worker_runs_at_lower_priority_under_its_own_name(tmp_path):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice and thread names are Linux only")
    with manager(tmp_path) as mgr:
        mgr.save(2, {"w": torch.ones(4)})
        mgr.wait()
        worker = mgr._pipeline._thread.native_id
        main = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, worker) == min(19, main + 10)
        # top -H, perf and /proc show which thread is the checkpoint worker.
        with open(f"/proc/self/task/{worker}/comm") as f:
            assert f.read().strip() == "unbroken-ckpt"


def manifest_files(tmp_path, step: int) -> list[dict]:
    doc = json.loads((tmp_path / "durable" / step_dir(step) / "manifest.json").read_text())
    return doc["files"]


def test_staging_shards_are_written_with_o_direct_from_the_host_buffers(tmp_path):
    """Large payloads start on 4 KiB file offsets and reach the disk without page cache."""
    staging = tmp_path / "staging"
    state = {"w": torch.full((300_000,), 1.0), "b": torch.arange(10.0), "n": 3}
    with manager(tmp_path, keep_last=1) as mgr:
        for step in (1, 2):
            sent_before = mgr.stats.bytes_from_memory
            state["w"].fill_(float(step))
            mgr.save(step, state)
            mgr.wait()
        meta = json.loads((staging / step_dir(2) / "metadata.json").read_text())
        records = sorted((e["record"], e["payload"], e["fqn"]) for e in meta["storage_data"])
        payloads = {fqn: payload for _, payload, fqn in records}
        assert payloads["w"][0] % 4096 == 0  # large: on a block boundary
        for (prev, _, _), (record, _, fqn) in itertools.pairwise(records):
            if fqn != "w":  # small ones are packed: at most 63 bytes of padding
                assert 0 <= record[0] - (prev[0] + prev[1]) < 64, fqn
        # The uploads sent the shard and DCP's metadata from memory, not read back from
        # the staging tier; only the small RNG file went from disk.
        written = {r["name"]: r["size"] for r in manifest_files(tmp_path, 2)}
        from_memory = sum(size for name, size in written.items() if not name.startswith("rng/"))
        assert mgr.stats.bytes_from_memory == from_memory + sent_before > sent_before > 0
        if mgr.stats.bytes_direct == 0:
            pytest.skip(f"{staging} refuses O_DIRECT: shards go through the page cache")
        # Both saves' 1.2 MB payload went from the host buffer itself, in whole blocks.
        assert mgr.stats.bytes_direct >= 2 * (1_200_000 // 4096) * 4096
        assert verify_checkpoint(ub.open_store(str(staging)), 2, deep=True) == []
        fresh = {"w": torch.zeros(300_000), "b": torch.zeros(10), "n": 0}
        assert mgr.restore(fresh) == 2
        assert mgr.last_restore.tier == "staging"
        assert torch.equal(fresh["w"], torch.full((300_000,), 2.0))
        assert torch.equal(fresh["b"], torch.arange(10.0)) and fresh["n"] == 3


def test_the_local_write_reuses_the_checksums_taken_while_staging(tmp_path):
    """Every tensor byte is read once for its checksum, during the staging copy, and the
    checkpoint that results verifies byte for byte."""
    state = {"w": torch.randn(300_000), "b": torch.arange(10.0), "n": 3}
    with manager(tmp_path, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state)
            mgr.wait()
        tensor_bytes = state["w"].nbytes + state["b"].nbytes
        assert mgr.stats.bytes_checksummed_in_copy == 2 * tensor_bytes
        assert verify_checkpoint(ub.open_store(str(tmp_path / "durable")), 2, deep=True) == []
        fresh = {"w": torch.zeros(300_000), "b": torch.zeros(10), "n": 0}
        assert mgr.restore(fresh) == 2
    assert torch.equal(fresh["w"], state["w"]) and torch.equal(fresh["b"], state["b"])


@pytest.mark.parametrize("shared", [False, True])
def test_close_returns_the_staging_buffers_while_the_manager_is_referenced(tmp_path, shared):
    mgr = manager(tmp_path, staging_shared_memory=shared)
    weights = {"w": torch.ones(8 * 2**20)}  # 32 MiB
    before = host_rss()
    mgr.save(2, weights)
    mgr.wait()
    assert host_rss() - before >= 16 * 2**20
    mgr.close()
    assert host_rss() - before < 4 * 2**20


def test_plain_values_come_back_exactly_non_finite_floats_included(tmp_path):
    import math

    values = {"best_loss": math.inf, "history": [1.5, -math.inf, math.nan], "epoch": 3}
    with manager(tmp_path) as mgr:
        assert mgr.save(2, {"w": torch.ones(4), **values})
        mgr.wait()
        fresh = {"w": torch.zeros(4), "best_loss": 0.0, "history": [], "epoch": 0}
        assert mgr.restore(fresh) == 2
    assert fresh["best_loss"] == math.inf and fresh["epoch"] == 3
    assert fresh["history"][:2] == [1.5, -math.inf] and math.isnan(fresh["history"][2])
    text = (tmp_path / "durable" / step_dir(2) / "manifest.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"manifest holds {name}"))


def test_values_that_json_would_change_are_refused_before_anything_is_saved(tmp_path):
    with manager(tmp_path) as mgr:
        with pytest.raises(TypeError, match=r"state\['pos'\] is a tuple"):
            mgr.save(2, {"w": torch.ones(4), "pos": (3, 7)})
        with pytest.raises(TypeError, match=r"state\['seen'\] has the key 1 \(int\)"):
            mgr.save(2, {"w": torch.ones(4), "seen": {1: True}})
        assert mgr.stats.started == 0
    assert mgr.checkpoints() == []


def outage_manager(tmp_path: Path, **kw) -> tuple[ub.CheckpointManager, Path]:
    """A manager whose emulated durable tier is down while the returned file exists."""
    switch = tmp_path / "outage"
    opts = {"latency": 0, "bandwidth": None, "outage_file": str(switch)}
    url = "emulated::" + str(tmp_path / "durable")
    return manager(tmp_path, url=url, storage_options=opts, retry=FAST_RETRY, **kw), switch


def test_a_failed_save_leaves_no_shard_behind_and_its_step_can_be_saved_again(tmp_path):
    mgr, switch = outage_manager(tmp_path)
    state = make_state()
    switch.write_text("down")
    for step in (2, 4, 6):  # a store down for several saves must not fill the staging disk
        assert mgr.save(step, state)
        mgr._pipeline.wait()
        assert not (tmp_path / "staging" / step_dir(step)).exists(), step
    switch.unlink()
    with pytest.warns(RuntimeWarning, match="step 6 failed"):
        assert mgr.save(6, state)  # the step that failed is saved again, not skipped
    mgr.close()
    assert [c.step for c in mgr.checkpoints() if c.committed] == [6]
    assert (tmp_path / "staging" / step_dir(6) / "manifest.json").exists()


def test_a_failed_synchronous_save_returns_false(tmp_path):
    mgr, switch = outage_manager(tmp_path, async_save=False)
    switch.write_text("down")
    with pytest.warns(RuntimeWarning, match="step 2 failed"):
        assert mgr.save(2, make_state()) is False
    assert [e.step for e in mgr.failures] == [2]
    with pytest.raises(SaveFailedError, match=r"step 2 failed.*warned before"):
        mgr.close()


def test_a_run_whose_last_saves_failed_does_not_end_quietly(tmp_path):
    """maybe_save warns of each failure once; close() must still say that the run ends
    without its progress saved, or a loop that only calls maybe_save exits 0."""
    mgr, switch = outage_manager(tmp_path)
    state = make_state()
    switch.write_text("down")
    with pytest.warns(RuntimeWarning, match="step 2 failed"):
        for step in range(1, 6):
            mgr.maybe_save(step, state)
            mgr._pipeline.wait()
    with pytest.raises(SaveFailedError, match=r"step 4 failed.*no save committed after it"):
        mgr.close()


def test_close_warns_of_an_earlier_failure_a_later_commit_made_good(tmp_path):
    """A failure recorded while the next save waited for it (so no call reported it yet)
    is warned about at close, not raised: the run ends with its progress committed."""
    mgr, switch = outage_manager(tmp_path)
    state = make_state()
    switch.write_text("down")
    mgr.save(2, state)
    mgr._pipeline.wait()  # step 2 failed; nothing has reported it
    switch.unlink()
    mgr._save(4, state, skip_if_busy=False)  # as save() does once it waited for step 2
    with pytest.warns(RuntimeWarning, match="step 2 failed"):
        mgr.close()
    assert [c.step for c in mgr.checkpoints() if c.committed] == [4]
    assert [e.step for e in mgr.failures] == [2]


def test_a_failure_kept_in_failures_does_not_keep_the_staging_buffers(tmp_path):
    mgr, switch = outage_manager(tmp_path)
    weights = {"w": torch.ones(8 * 2**20)}  # 32 MiB
    before = host_rss()
    switch.write_text("down")
    mgr.save(2, weights)
    with pytest.raises(SaveFailedError, match="step 2"):
        mgr.close()
    assert mgr.failures and mgr.failures[0].__cause__ is not None  # the cause is still there
    assert host_rss() - before < 4 * 2**20


def test_module_buffers_are_staged_first_whatever_the_wrappers_call_them():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from unbroken.checkpoint.state_dicts import collect

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            self.block = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))

    flat = collect({"model": Holder(), "w": torch.ones(2)})
    stats = ("running_mean", "running_var", "num_batches_tracked")
    expected = {f"model.{m}.1.{s}" for m in ("module", "block") for s in stats}
    assert expected <= set(flat.tensors)
    assert flat.first == expected


def test_a_users_links_pipes_and_sockets_beside_the_checkpoints_are_left_alone(tmp_path):
    """A hostile user's find, against the listing that first refused links out of the
    root: one ``tb -> /scratch/tb`` link in the checkpoint folder broke restore, every
    save and the CLI. None of these is a checkpoint's file: all are left alone."""
    import socket

    ck = tmp_path / "ck"
    ck.mkdir()
    (tmp_path / "tb").mkdir()
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    os.symlink(tmp_path / "tb", ck / "tb")
    os.symlink("../config.yaml", ck / "config.yaml")
    os.symlink("..", ck / "parent")
    os.symlink("step-000000000002", ck / "latest")
    os.mkfifo(ck / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ck / "sock"))
    try:
        model = nn.Linear(4, 4)
        state = {"model": model}
        mgr = ub.CheckpointManager(ck, staging_dir=tmp_path / "st", keep_last=2)
        for step in (1, 2, 3):
            assert mgr.save(step, state)
        mgr.close()
        assert [c.step for c in mgr.checkpoints()] == [2, 3]  # pruned past the links
        fresh = ub.CheckpointManager(ck, staging_dir=tmp_path / "st2", memory_tier=False)
        assert fresh.restore({"model": nn.Linear(4, 4)}) == 3
        fresh.close()
        for command in ("ls", "verify"):
            cli = subprocess.run(
                [sys.executable, "-m", "unbroken.cli", command, str(ck)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert cli.returncode == 0, cli.stdout + cli.stderr
        assert (tmp_path / "config.yaml").read_text() == "lr: 0.1\n"
    finally:
        sock.close()


_RESTORE_AS_A_USER = """
import sys, torch, unbroken as ub
mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], memory_tier=False)
try:
    print("RESTORED", mgr.restore({"w": torch.zeros(4)}))
except ub.StoreError as e:
    print("REFUSED", e)
"""


def test_an_unreadable_step_folder_fails_restore_naming_it_and_a_users_folder_does_not(
    tmp_path,
):
    """An unreadable step folder made restore() start from scratch (a hostile user's
    find); one of the user's own folders beside the steps must not stop restores."""
    import shutil

    ck = tmp_path / "ck"
    mgr = ub.CheckpointManager(ck, staging_dir=tmp_path / "st", memory_tier=False)
    mgr.save(1, {"w": torch.zeros(4)})
    mgr.save(2, {"w": torch.ones(4)})
    mgr.close()
    cmd = [sys.executable, "-c", _RESTORE_AS_A_USER, str(ck), str(tmp_path / "st2")]
    if os.geteuid() == 0:  # root ignores file modes: drop what lets it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes do not bind")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    (ck / "tb").mkdir()
    for folder, expected in (("tb", "RESTORED 2"), (step_dir(2), "REFUSED")):
        (ck / folder).chmod(0)
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        finally:
            (ck / folder).chmod(0o755)
        assert expected in run.stdout, run.stdout + run.stderr
    assert f"checkpoint folder {ck / step_dir(2)} cannot be read" in run.stdout, run.stdout


def steps_2_and_4_by_another_process(tmp_path: Path) -> tuple[str, str]:
    """A run (another process, now ended) that committed steps 2 and 4 of ``{"w": ...}``:
    its durable URL and staging dir."""
    first = (
        "import sys, torch, unbroken as ub\n"
        "with ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2]) as m:\n"
        "    for step in (2, 4):\n"
        "        m.save(step, {'w': torch.full((4,), float(step))})\n"
    )
    url, staging = str(tmp_path / "d"), str(tmp_path / "s")
    subprocess.run([sys.executable, "-c", first, url, staging], check=True, timeout=120)
    return url, staging


def test_a_step_an_earlier_attempt_committed_after_the_restored_one_is_named_so(
    tmp_path, monkeypatch
):
    """A run whose restore passed over the newest step (corrupt) reaches that step: it is
    never overwritten, and the message says it is this job's, not another job's."""
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-x")
    url, staging = steps_2_and_4_by_another_process(tmp_path)
    flip_payload_byte(tmp_path / "d" / step_dir(4), key="w")
    state = {"w": torch.zeros(4)}
    with (
        pytest.raises(SaveFailedError) as info,
        ub.CheckpointManager(url, staging_dir=staging) as mgr,
    ):
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert mgr.restore(state) == 2
        mgr.save(4, state)
        mgr.wait()
    message = str(info.value)
    assert "by an earlier attempt of this job" in message and "two jobs" not in message
    assert "never overwritten" in message


def test_a_damaged_step_reached_again_is_named_damaged_and_left_as_it_is(tmp_path):
    """A step whose manifest outlived one of its files (deleted by hand, a partial
    ``aws s3 rm``): the restore passes over it; reaching it again, the run is told the
    step is damaged (not "already committed" by another writer) and saves the next one."""
    url, staging = steps_2_and_4_by_another_process(tmp_path)
    damaged = tmp_path / "d" / step_dir(4)
    (damaged / "__0_0.distcp").unlink()
    left = sorted(p.name for p in damaged.iterdir())
    state = {"w": torch.zeros(4)}
    with ub.CheckpointManager(url, staging_dir=staging) as mgr:
        with pytest.warns(RuntimeWarning, match="not usable"):
            assert mgr.restore(state) == 2
        mgr.save(4, state)
        with pytest.raises(SaveFailedError) as info:
            mgr.wait()
        mgr.save(6, state)
        mgr.wait()
    message = str(info.value)
    assert "damaged" in message and "__0_0.distcp" in message, message
    assert "claim" not in message and "already committed" not in message, message
    assert sorted(p.name for p in damaged.iterdir()) == left
    assert [c.step for c in mgr.checkpoints() if c.committed] == [2, 6]


def test_milestones_are_saved_whatever_the_cadence_and_never_skipped_busy(tmp_path):
    """keep_every_steps=5 beside every_steps=3: steps 5 and 10 were never due, and each
    is reached while a save still uploads, where a save that is due is skipped."""
    opts = {"latency": 0, "bandwidth": "1MB", "link": private_link("milestones")}
    state = {"w": torch.zeros(250_000)}  # 1 MB: about 1 s per upload on the emulated link
    url = "emulated::" + str(tmp_path / "durable")
    mgr = manager(tmp_path, url=url, storage_options=opts, every_steps=3, keep_last=1,
                  keep_every_steps=5, when_busy="skip")  # fmt: skip
    for step in range(1, 11):
        state["w"] = torch.full((250_000,), float(step))  # (in place would tear the copy)
        mgr.maybe_save(step, state)
    mgr.close()
    committed = [c.step for c in mgr.checkpoints() if c.committed]
    assert {5, 10} <= set(committed), committed
    assert mgr.stats.skipped_busy >= 1  # the cadence's own saves are skipped as before
    fresh = {"w": torch.zeros(250_000)}
    with manager(tmp_path, url=url, storage_options=opts) as again:
        assert again.restore(fresh, step=5) == 5
    assert torch.all(fresh["w"] == 5.0)


INTERRUPTED_SAVE = """
import os, signal, sys, torch, unbroken as ub
model = torch.nn.Linear(8, 8)
state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], every_steps=1)
armed = [True]
def ctrl_c_inside(frame, event, arg):  # a real SIGINT, landing as the RNG states are read
    if armed[0] and event == "call" and frame.f_code.co_name == sys.argv[3]:
        armed[0] = False
        os.kill(os.getpid(), signal.SIGINT)
sys.setprofile(ctrl_c_inside)
try:
    mgr.save(1, state)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.setprofile(None)
for step in (2, 3):
    assert mgr.maybe_save(step, state), f"step {step} not saved"
    mgr.wait()
mgr.close()
print("committed", [c.step for c in mgr.checkpoints() if c.committed])
"""


@pytest.mark.parametrize("where", ["capture_rng_state", "hold"])
def test_a_save_interrupted_by_ctrl_c_gives_the_buffers_back(tmp_path, where):
    """Ctrl-C (a notebook's interrupt) inside save(), once the snapshot held the buffers
    and before the job existed: every later save was skipped as busy, or hung."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_SAVE, str(tmp_path / "d"), str(tmp_path / "s"), where],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "interrupted" in out.stdout and "committed [2, 3]" in out.stdout, out.stdout


INTERRUPTED_RESTORE = """
import os, shutil, signal, sys, warnings, torch, unbroken as ub
durable, staging, tier = sys.argv[1:4]
def state(fill):
    return {"w": torch.full((1 << 16,), float(fill)), "step_count": 0}
if tier.startswith("save"):  # the writer: to leave its memory copy, it ends as a crash
    mgr = ub.CheckpointManager(durable, staging_dir=staging)
    mgr.save(1, state(7)); mgr.wait()
    os._exit(0) if tier == "save-memory" else mgr.close()
    shutil.rmtree(staging)  # a clean end removed the memory copy: the durable tier alone
    sys.exit(0)
warnings.simplefilter("error")  # a fallback to another tier warns: none may happen
mgr = ub.CheckpointManager(durable, staging_dir=staging)
armed = [True]
def ctrl_c_inside(frame, event, arg):  # a real SIGINT, landing inside the read
    if armed[0] and event == "call" and frame.f_code.co_name == "read_data":
        armed[0] = False
        os.kill(os.getpid(), signal.SIGINT)
target = state(0)
sys.setprofile(ctrl_c_inside)
try:
    mgr.restore(target)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.setprofile(None)
assert not armed[0], "the read was never reached"
step, restored = mgr.restore(target), mgr.last_restore
print("restored", step, restored.tier, float(target["w"].max()), float(target["w"].min()))
mgr.close()
"""


@pytest.mark.parametrize("tier", ["memory", "durable"])
def test_ctrl_c_inside_a_restore_stops_it(tmp_path, tier):
    """Ctrl-C while a restore read its tensors came out as a damaged copy: from the memory
    tier the restore warned and read everything again from the durable tier; from the
    durable tier it raised CheckpointError. It is the user's KeyboardInterrupt, and a
    restore run again afterwards loads the step whole."""
    args = [str(tmp_path / "d"), str(tmp_path / "s")]
    run = [sys.executable, "-c", INTERRUPTED_RESTORE, *args]
    saved = subprocess.run([*run, f"save-{tier}"], capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-2000:]
    out = subprocess.run([*run, tier], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["interrupted", f"restored 1 {tier} 7.0 7.0"], out.stdout


def test_every_rank_ends_a_restore_one_rank_was_interrupted_in():
    """DCP hands every rank every rank's failure: the interrupted rank raises its own
    KeyboardInterrupt, the others an error naming it; a real fault is left to fall back."""
    failures = {0: ValueError("a torn file"), 2: KeyboardInterrupt(), 3: SystemExit(4)}
    with pytest.raises(KeyboardInterrupt):
        raise_if_interrupted(failures, 2, 9)
    with pytest.raises(SystemExit) as exited:
        raise_if_interrupted(failures, 3, 9)
    assert exited.value.code == 4
    with pytest.raises(CheckpointError, match=r"step 9 was stopped: rank 2 was interrupted"):
        raise_if_interrupted(failures, 0, 9)
    raise_if_interrupted({0: ValueError("a torn file")}, 0, 9)  # not a stop: no raise


def test_a_killed_writers_temp_file_goes_when_its_step_is_committed_again(tmp_path):
    """A save killed mid-write leaves its shard's temp file in the step's folder on a
    local durable path; the next attempt commits that step beside it, and it stayed, as
    large as a shard, that neither `unbroken ls` nor `verify` showed."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    folder = tmp_path / "d" / step_dir(2)
    folder.mkdir(parents=True)
    left = folder / f".__0_0.distcp{TEMP_MARKER}{dead}-53063ef3"  # as temp_name() makes
    left.write_bytes(b"x" * 4096)
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(2, {"w": torch.ones(4)})
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [
        ".metadata", "__0_0.distcp", "manifest.json", "metadata.json", "writer.json"
    ]  # fmt: skip


INTERRUPTED_CLOSE = """
import os, signal, sys, torch, unbroken as ub
previous = signal.getsignal(signal.SIGTERM)
mgr = ub.CheckpointManager(sys.argv[1], staging_dir=sys.argv[2], memory_tier=False)
mgr.save(1, {"w": torch.ones(4)})
armed = [True]
def ctrl_c_inside(frame, event, arg):  # a real SIGINT, landing as close() waits
    if armed[0] and event == "call" and frame.f_code.co_qualname == "SavePipeline.wait":
        armed[0] = False
        os.kill(os.getpid(), signal.SIGINT)
sys.setprofile(ctrl_c_inside)
try:
    mgr.close()
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.setprofile(None)
print("handler back", signal.getsignal(signal.SIGTERM) == previous)
print("attempt ended", mgr._goodput._closed)
"""


def test_a_close_interrupted_by_ctrl_c_and_caught_still_ends_the_manager(tmp_path):
    """Ctrl-C as close() waited, caught by the user's script: the manager was marked
    closed with its SIGTERM handler still installed (a later SIGTERM waited 10 s for a
    maybe_save) and its goodput attempt never ended; a second close() did nothing."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_CLOSE, str(tmp_path / "d"), str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["interrupted", "handler back True", "attempt ended True"], out.stdout
