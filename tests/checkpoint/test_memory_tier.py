"""The memory tier: a node's copy of the newest committed checkpoint in shared memory.

Processes here are real: a job SIGKILLed (or preempted) after its commit, then restored
by a new process, as torchrun restarts a rank. Tests on a real small tmpfs mount one
(Docker's default /dev/shm is 64 MB) and skip where this machine does not let them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import unbroken as ub
from tests.checkpoint.manager_util import make_state, rng_draws, snapshot, train
from tests.link_names import private_link
from unbroken._util.procs import process_start_ticks
from unbroken.checkpoint.format.manifest import parse_step_dir, step_dir
from unbroken.checkpoint.format.shard_layout import lay_out
from unbroken.checkpoint.memory_tier import (
    MEMORY_DIR_ENV,
    SWEEP_GRACE_SECONDS,
    MemoryTierError,
    Space,
    default_root,
    space,
    tier_key,
)
from unbroken.checkpoint.staging.arena import RankArenas
from unbroken.goodput.events import read_log

JOB = Path(__file__).with_name("memory_job.py")

pytestmark = pytest.mark.multiprocess


def run_job(tmp_path: Path, end: str, staging: str = "staging", via_shell: bool = False):
    """Run memory_job.py to its end; (returncode, its output)."""
    out = tmp_path / f"out-{end}"
    out.mkdir(exist_ok=True)
    durable, staging_dir = str(tmp_path / "durable"), str(tmp_path / staging)
    cmd = [sys.executable, str(JOB), durable, staging_dir, str(out), end]
    if via_shell:  # the job's parent ends too: no process of it is left
        cmd = ["sh", "-c", " ".join(cmd) + "; exit 0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if end == "sigterm":
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]
        assert lines[0].startswith("committed 4"), lines
        proc.send_signal(signal.SIGTERM)
        lines.append(proc.stdout.read())
        return proc.wait(60), "".join(lines)
    text, _ = proc.communicate(timeout=120)
    return proc.returncode, text


def restored(tmp_path: Path, staging: str = "staging", **kw) -> tuple[ub.CheckpointManager, dict]:
    mgr = ub.CheckpointManager(
        tmp_path / "durable", staging_dir=tmp_path / staging, every_steps=2, **kw
    )
    state = make_state(1, lr=0.9)
    mgr.restore(state)
    return mgr, state


def memory_dir(tmp_path: Path, staging: str = "staging") -> Path:
    """Where run_job's node keeps its memory tier."""
    url = ub.open_store(str(tmp_path / "durable")).url
    return Path(default_root()) / tier_key(str(tmp_path / staging), url)


def restores_bitwise_from(tmp_path: Path, tier: str, *, draws: bool = False) -> None:
    """A fresh process's restore after run_job's kill: read from ``tier``, equal to what
    the killed job held (and its RNG draws after it, with ``draws``)."""
    mgr, state = restored(tmp_path)
    try:
        assert mgr.last_restore.tier == tier, mgr.last_restore
        same(tensors(state), torch.load(tmp_path / "out-kill" / "expected.pt", weights_only=True))
        if draws:
            assert rng_draws() == json.loads((tmp_path / "out-kill" / "draws.json").read_text())
    finally:
        mgr.close()


def tensors(state: dict) -> dict:
    return {k: v for k, v in snapshot(state).items() if isinstance(v, torch.Tensor)}


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def steps_in(path: str | Path) -> list[int]:
    return sorted(s for e in os.listdir(path) if (s := parse_step_dir(e)) is not None)


def test_a_process_killed_after_its_commit_restores_from_memory_bitwise(tmp_path, caplog):
    code, out = run_job(tmp_path, "kill")
    assert code == -signal.SIGKILL, out
    assert not (tmp_path / "staging" / step_dir(4)).exists()  # the node's copy is in memory
    caplog.set_level(logging.INFO, logger="unbroken.checkpoint.recovery")
    mgr, state = restored(tmp_path)
    try:
        assert mgr.last_restore.step == 4 and mgr.last_restore.tier == "memory", mgr.last_restore
        same(tensors(state), torch.load(tmp_path / "out-kill" / "expected.pt", weights_only=True))
        assert rng_draws() == json.loads((tmp_path / "out-kill" / "draws.json").read_text())
        assert "restored step 4 from the memory tier" in caplog.text
    finally:
        mgr.close()
    ends = [
        e.info.get("tier")
        for events in read_log(ub.open_store(str(tmp_path / "durable"))).values()
        for rank_events in events.values()
        for e in rank_events
        if e.kind == "restore_end" and e.step == 4
    ]
    assert ends == ["memory"], ends  # the goodput log says where the restore came from


def test_a_preempted_job_keeps_its_memory_copy_and_a_clean_end_removes_it(tmp_path):
    code, out = run_job(tmp_path, "sigterm")
    assert code == 143, out
    mgr, state = restored(tmp_path)
    path = mgr.memory_tier.path
    assert mgr.last_restore.step > 4 and mgr.last_restore.tier == "memory", mgr.last_restore
    same(tensors(state), torch.load(tmp_path / "out-sigterm" / "expected.pt", weights_only=True))
    assert steps_in(path) == [mgr.last_restore.step]
    mgr.close()
    assert not os.path.exists(path)  # a clean end leaves nothing in shared memory


def test_a_corrupt_memory_copy_falls_back_to_the_durable_tier(tmp_path):
    code, out = run_job(tmp_path, "kill")
    assert code == -signal.SIGKILL, out
    from tests.checkpoint.manager_util import flip_payload_byte

    memory = memory_dir(tmp_path)
    flip_payload_byte(memory / step_dir(4), "optim.state.0.weight.exp_avg")
    with pytest.warns(RuntimeWarning, match=r"crc32c mismatch"):
        restores_bitwise_from(tmp_path, "durable")


def test_a_file_missing_from_memory_is_read_from_the_durable_tier(tmp_path):
    code, out = run_job(tmp_path, "kill")
    assert code == -signal.SIGKILL, out
    memory = memory_dir(tmp_path)
    (memory / step_dir(4) / "rng" / "rank-00000.json").unlink()
    restores_bitwise_from(tmp_path, "memory+durable", draws=True)


def test_two_jobs_on_one_node_keep_their_memory_copies_apart(tmp_path):
    a = ub.CheckpointManager(tmp_path / "a", staging_dir=tmp_path / "sa", every_steps=1)
    b = ub.CheckpointManager(tmp_path / "b", staging_dir=tmp_path / "sb", every_steps=1)
    try:
        assert a.memory_tier.path != b.memory_tier.path
        sa, sb = make_state(0), make_state(5)
        train(sa, range(1, 2))
        train(sb, range(1, 2))
        a.save(1, sa)
        b.save(3, sb)
        a.wait()
        b.wait()
        assert steps_in(a.memory_tier.path) == [1] and steps_in(b.memory_tier.path) == [3]
        fresh = make_state(9)
        assert b.restore(fresh) == 3 and b.last_restore.tier == "memory"
        same(tensors(fresh), tensors(sb))
    finally:
        a.close()
        b.close()


def test_jobs_that_name_one_staging_path_keep_their_memory_copies_apart(tmp_path):
    """Containers that share the host's /dev/shm (``--ipc=host``) and mount a volume each
    at one staging path: the memory tier was keyed by that path alone, so the other job's
    clean end removed this job's copy (its restart then read the durable tier)."""
    code, out = run_job(tmp_path, "kill")  # this job: step 4 committed, then killed
    assert code == -signal.SIGKILL, out
    other = make_state(7)
    train(other, range(1, 2))
    with ub.CheckpointManager(tmp_path / "other-job", staging_dir=tmp_path / "staging") as b:
        assert b.memory_tier.path != str(memory_dir(tmp_path))
        b.save(1, other)  # its own copy and its clean end, beside this job's copy
    assert steps_in(memory_dir(tmp_path)) == [4]
    restores_bitwise_from(tmp_path, "memory")


def _age(tree: Path, seconds: float) -> None:
    """Make every folder of ``tree`` look ``seconds`` old (as time passing would)."""
    when = time.time() - seconds
    for folder, _, _ in os.walk(tree):
        os.utime(folder, (when, when))


def test_a_job_whose_every_process_was_killed_is_swept_by_the_next(tmp_path):
    code, out = run_job(tmp_path, "kill", via_shell=True)  # the job and its launcher gone
    assert code == 0, out
    left = memory_dir(tmp_path)
    assert steps_in(left) == [4]
    # just killed: it may be starting again (a container restarted in place), so kept
    ub.CheckpointManager(tmp_path / "other", staging_dir=tmp_path / "other-staging").close()
    assert steps_in(left) == [4]
    _age(left, SWEEP_GRACE_SECONDS + 5)  # nothing of it changed for the grace: swept
    other = ub.CheckpointManager(tmp_path / "other", staging_dir=tmp_path / "other-staging")
    try:
        assert not left.exists()
        assert os.path.exists(other.memory_tier.path)
    finally:
        other.close()


def test_a_dead_nodes_tier_of_this_very_job_is_kept_through_its_restart(tmp_path, monkeypatch):
    # two nodes of one job on one machine, every process killed: the node that starts
    # first must not take the other's memory copy (it restores from it in a moment); a
    # tier idle past the grace goes, this job's or not (a job id can be reused)
    monkeypatch.setenv("UNBROKEN_JOB_ID", "job-a")
    code, out = run_job(tmp_path, "kill", via_shell=True)
    assert code == 0, out
    left = memory_dir(tmp_path)
    ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "node-1").close()
    assert steps_in(left) == [4]
    _age(left, SWEEP_GRACE_SECONDS + 5)
    ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "node-1").close()
    assert not left.exists()


def test_a_memory_dir_that_others_use_too_is_left_as_it_is(tmp_path, monkeypatch):
    # UNBROKEN_MEMORY_DIR pointed at a tmpfs mount point other programs use: the tier
    # keeps a folder of its own there and touches nothing else, however old
    shared = tmp_path / "shared-tmpfs"
    (shared / "other_app").mkdir(parents=True)
    (shared / "other_app" / "data.bin").write_bytes(b"theirs")
    (shared / "0123456789abcdef").mkdir()  # even a name that looks like a tier's
    shared.chmod(0o1777)
    _age(shared, SWEEP_GRACE_SECONDS + 5)
    monkeypatch.setenv(MEMORY_DIR_ENV, str(shared))
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, make_state(0))
        assert Path(mgr.memory_tier.path).parent == shared / f"unbroken-{os.getuid()}"
    assert (shared / "other_app" / "data.bin").read_bytes() == b"theirs"
    assert (shared / "0123456789abcdef").is_dir()
    assert shared.stat().st_mode & 0o7777 == 0o1777


def test_a_link_in_place_of_the_tiers_root_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(MEMORY_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm" / f"unbroken-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.warns(RuntimeWarning, match="the memory tier is off: .* not a directory"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s").close()
    with pytest.raises(MemoryTierError, match="not a directory"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", memory_tier=True)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_live_jobs_copy_is_never_swept(tmp_path):
    mgr = ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", every_steps=1)
    try:
        state = make_state(0)
        mgr.save(1, state)
        mgr.wait()
        other = ub.CheckpointManager(tmp_path / "d2", staging_dir=tmp_path / "s2")
        other.close()
        assert steps_in(mgr.memory_tier.path) == [1]
    finally:
        mgr.close()


def test_memory_tier_must_be_a_bool_or_none(tmp_path):
    with pytest.raises(ValueError, match="memory_tier must be None"):
        ub.CheckpointManager(tmp_path / "d", memory_tier="yes")


def test_off_keeps_the_node_copy_on_disk(tmp_path):
    with ub.CheckpointManager(
        tmp_path / "d", staging_dir=tmp_path / "s", every_steps=1, memory_tier=False
    ) as mgr:
        assert mgr.memory_tier is None
        mgr.save(1, make_state(0))
        mgr.wait()
        assert steps_in(tmp_path / "s") == [1]
        fresh = make_state(2)
        mgr.restore(fresh)
        assert mgr.last_restore.tier == "staging"


# -- a small tmpfs, as containers mount one ---------------------------------------------


def big_state(mib: int) -> dict:
    torch.manual_seed(0)
    return {"weights": torch.randn(mib << 18), "step": 0}  # mib MiB of float32


def test_a_tmpfs_too_small_turns_the_tier_off_with_one_warning(tmp_path, small_tmpfs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", every_steps=1) as mgr:
            state = big_state(24)  # two snapshots: 48 MiB, past what 64 MiB leaves room for
            mgr.save(1, state)
            mgr.save(2, state)
            mgr.wait()
            assert steps_in(tmp_path / "s") == [2]  # on disk instead
            fresh = {"weights": torch.zeros(24 << 18), "step": -1}
            assert mgr.restore(fresh) == 2 and mgr.last_restore.tier == "staging"
    said = [str(w.message) for w in caught if "memory tier" in str(w.message)]
    assert len(said) == 1, said
    assert "50.3 MB" in said[0] and "memory_tier=False" in said[0] and "--shm-size" in said[0]


def test_a_tmpfs_too_small_is_an_error_with_memory_tier_true(tmp_path, small_tmpfs):
    mgr = ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", memory_tier=True)
    try:
        for step in (1, 2):  # every save, not only the first (the next went to disk)
            with pytest.raises(MemoryTierError, match=r"needs 50\.3 MB"):
                mgr.save(step, big_state(24))
        mgr.wait()
        assert not (tmp_path / "d" / step_dir(1)).exists()  # nothing was saved
        assert not (tmp_path / "d" / step_dir(2)).exists()
    finally:
        mgr.close()


def test_the_reserve_is_a_tenth_of_the_tmpfs_within_bounds_that_others_need():
    gib = 1 << 30
    assert Space(free=0, total=24 * gib).reserve == int(2.4 * gib)
    assert Space(free=0, total=64 << 20).reserve == 32 << 20  # half of a small tmpfs
    assert Space(free=0, total=1 * gib).reserve == 256 << 20
    assert Space(free=0, total=1024 * gib).reserve == 4 * gib  # not 102 GiB
    # a shared 270 GB tmpfs with 25 GB free holds a 16.8 MB tier (the reserve was 27 GB)
    assert Space(free=24_900_000_000, total=270_600_000_000).room_for(16_800_000)


def test_a_tmpfs_filled_by_others_sends_saves_to_disk_never_past_the_cap(tmp_path, small_tmpfs):
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", every_steps=1) as mgr:
        state = big_state(8)  # 16 MiB for two: fits
        mgr.save(1, state)
        mgr.wait()
        assert steps_in(mgr.memory_tier.path) == [1]
        st = os.statvfs(small_tmpfs)  # another user of /dev/shm leaves less than the reserve
        with open(small_tmpfs / "someone-else", "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - (3 << 20)))
        mgr.save(2, state)
        mgr.wait()
        assert steps_in(tmp_path / "s") == [2]
        assert steps_in(mgr.memory_tier.path) == []  # the older copy is tidied away
        st = os.statvfs(small_tmpfs)
        assert st.f_bavail * st.f_frsize >= (64 << 20) // 10  # the reserve was kept
        os.unlink(small_tmpfs / "someone-else")
        mgr.save(3, state)
        mgr.wait()
        assert steps_in(mgr.memory_tier.path) == [3] and steps_in(tmp_path / "s") == []


def test_no_room_for_an_arena_is_said_once_and_saves_stage_apart(tmp_path, small_tmpfs, caplog):
    """The staging copy writes into an arena's pages: they are taken when it is made,
    within the tier's reserve, so a tmpfs filled by others is said there (once) and the
    saves stage apart, never a SIGBUS in the loop. (A manager makes an arena once the
    older step has left the tier, in the room that step's copy had: only another user of
    the tmpfs taking that room between the two leaves none, as here.)"""
    caplog.set_level(logging.WARNING, logger="unbroken.checkpoint.staging.arena")
    tier = small_tmpfs / "tier"
    tier.mkdir()
    pair = RankArenas(str(tier), rank=0)
    layout = lay_out([("w", (0,), torch.float32, (1 << 20,))])  # 4 MiB
    room = space(str(tier))
    with open(small_tmpfs / "someone-else", "wb") as f:  # 1 MiB above the reserve
        f.write(b"\0" * (room.free - room.reserve - (1 << 20)))
    assert pair.prepare(layout) is False and pair.take(layout) is None
    assert pair.prepare(layout) is False and pair.nbytes == 0
    assert caplog.text.count("no room to stage the next saves in place") == 1
    os.unlink(small_tmpfs / "someone-else")
    assert pair.prepare(layout) is True
    arena = pair.take(layout)
    assert arena is not None and arena.views({"w": ((1 << 20,), torch.float32, False)})
    arena.release()
    pair.close()


def test_a_tier_sized_for_two_copies_keeps_back_to_back_saves_in_memory(
    tmp_path, small_tmpfs, caplog
):
    """A save staged apart (no arena was free as it staged) finds an idle arena by its
    local write: its pages are given back for the copy, not the save sent to disk."""
    caplog.set_level(logging.WARNING, logger="unbroken.checkpoint.memory_tier")
    url = f"emulated::{tmp_path / 'd'}"
    options = {"bandwidth": "40MB", "link": private_link("tight-tier")}
    with ub.CheckpointManager(
        url, staging_dir=tmp_path / "s", keep_last=3, storage_options=options
    ) as mgr:
        state = big_state(12)  # two copies and the reserve fit in 64 MiB, three do not
        mgr.save(1, state)
        mgr.wait()
        for step in range(2, 8):  # each stages while the one before still uploads
            state = {"weights": state["weights"] + 1.0, "step": step}
            mgr.save(step, state)
        mgr.wait()
        assert mgr.stats.committed == 7
    assert "saves go to the disk tier" not in caplog.text


def test_the_tier_directory_is_the_users_alone(tmp_path):
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        root = os.path.dirname(mgr.memory_tier.path)
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert os.stat(mgr.memory_tier.path).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("where", ["missing", "relative"])
def test_a_memory_dir_that_is_missing_or_relative_turns_the_tier_off(tmp_path, monkeypatch, where):
    # a typo would otherwise make a "memory" tier on whatever disk the path names
    named = str(tmp_path / "shm-typo") if where == "missing" else "relative-shm"
    monkeypatch.setenv(MEMORY_DIR_ENV, named)
    monkeypatch.chdir(tmp_path)
    why = "does not exist" if where == "missing" else "not an absolute path"
    with pytest.warns(RuntimeWarning, match=f"the memory tier is off: .*{why}"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s").close()
    with pytest.raises(MemoryTierError, match=why):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", memory_tier=True)
    assert not (tmp_path / named).exists()


def test_a_killed_attempts_owner_records_do_not_count_as_ranks_writing(tmp_path):
    # 4 ranks ran on this node, were killed, and 1 restarted (a resize): the room a save
    # asks for is this rank's bytes times the ranks writing now, not times 4
    dead = subprocess.Popen(["true"])
    dead.wait()
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        owners = Path(mgr.memory_tier.path) / ".owners"
        for rank in (1, 2, 3):
            (owners / f"rank-{rank:05d}.json").write_text(json.dumps({"pid": dead.pid}))
        assert mgr.memory_tier.ranks() == 1


def test_a_rank_that_is_its_containers_pid_1_is_live_and_an_earlier_pid_1_is_not(tmp_path):
    # `CMD ["python", "train.py"]` makes the rank pid 1 of its container: told apart from
    # an earlier container's pid 1 by its start time (a parent of 1 is init, never a job's)
    init_started = process_start_ticks(1)
    if init_started is None:
        pytest.skip("no /proc/1/stat here")
    gone = str(int(init_started) + 1)
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        owners = Path(mgr.memory_tier.path) / ".owners"
        records = {1: {"pid": 1, "started": init_started}, 2: {"pid": 1, "started": gone}}
        for rank, doc in records.items():
            (owners / f"rank-{rank:05d}.json").write_text(json.dumps(doc))
        assert mgr.memory_tier.ranks() == 2  # this one and the live pid 1
