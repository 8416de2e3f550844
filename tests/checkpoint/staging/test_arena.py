"""Staging straight into the memory tier's shard files (staging/arena.py).

From a state's second save on, the staging buffers of the keys this rank writes are the
payloads of its next shard in the memory tier: the node's copy and the buffers are the
same memory. What must hold: the shard is the file a plain write would make (vanilla
dcp.load reads it, restores are bitwise), a rank never holds more than two arenas, a
step's file is never written while a step links it, and a state whose layout changed
stages apart for that save, then in place again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import unbroken as ub
from tests.checkpoint.manager_util import make_state, snapshot, train
from tests.link_names import private_link
from unbroken.checkpoint.format.manifest import step_dir
from unbroken.checkpoint.format.shard_layout import lay_out
from unbroken.checkpoint.memory_tier import default_root, tier_key, tree_bytes
from unbroken.checkpoint.staging.arena import ARENAS_DIR, RankArenas


def tier(tmp_path: Path, url: str | None = None) -> Path:
    """The node's memory tier of ``url`` (default: the local durable path of manager())."""
    url = ub.open_store(url or str(tmp_path / "durable")).url
    return Path(default_root()) / tier_key(str(tmp_path / "staging"), url)


def manager(tmp_path: Path, **kw) -> ub.CheckpointManager:
    return ub.CheckpointManager(
        tmp_path / "durable", staging_dir=tmp_path / "staging", memory_tier=True, **kw
    )


def arenas(tmp_path: Path, url: str | None = None) -> list[Path]:
    folder = tier(tmp_path, url) / ARENAS_DIR
    return sorted(folder.iterdir()) if folder.exists() else []


def shard(tmp_path: Path, step: int, url: str | None = None) -> Path:
    return tier(tmp_path, url) / step_dir(step) / "__0_0.distcp"


def test_from_the_second_save_the_shard_is_staged_in_place(tmp_path):
    state = make_state(0)
    mgr = manager(tmp_path)
    try:
        staged = []
        for step in range(1, 5):
            train(state, range(step, step + 1))
            mgr.save(step, state)
            mgr.wait()
            staged.append(mgr.stats.bytes_staged_in_place)
            # the step's shard and the arena it was staged in are one file
            assert shard(tmp_path, step).stat().st_nlink == (1 if step == 1 else 2)
            assert len(arenas(tmp_path)) <= 2
        assert staged[0] == 0 and 0 < staged[1] < staged[2] < staged[3]
        expected = snapshot(state)
        # vanilla dcp.load reads the node's copy as it is
        flat = {f"model.{k}": torch.empty_like(v) for k, v in state["model"].state_dict().items()}
        dcp.load(flat, storage_reader=dcp.FileSystemReader(shard(tmp_path, 4).parent), no_dist=True)
        for k, v in flat.items():
            assert torch.equal(v, expected[k]), k
        # the node holds two snapshots (the committed one and the spare), not three
        size = shard(tmp_path, 4).stat().st_size
        assert tree_bytes(str(tier(tmp_path))) < 2 * size + (64 << 10)
    finally:
        mgr.close()
    assert not arenas(tmp_path)  # a clean end leaves nothing in the tier
    again = make_state(9)
    mgr = manager(tmp_path)
    try:
        assert mgr.restore(again) == 4
    finally:
        mgr.close()
    got = snapshot(again)
    for k, v in expected.items():
        assert torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k], k


def test_a_state_that_changed_shape_stages_apart_once_then_in_place_again(tmp_path):
    state = make_state(0)
    mgr = manager(tmp_path)
    try:
        for step in (1, 2):
            train(state, range(step, step + 1))
            mgr.save(step, state)
            mgr.wait()
        before = mgr.stats.bytes_staged_in_place
        state["ema"] = torch.arange(40.0)  # a key's shape changes: another layout
        mgr.save(3, state)
        mgr.wait()
        assert mgr.stats.bytes_staged_in_place == before  # this save staged apart
        mgr.save(4, state)
        mgr.wait()
        assert mgr.stats.bytes_staged_in_place > before
        assert len(arenas(tmp_path)) <= 2
        expected = snapshot(state)
    finally:
        mgr.close()
    again = make_state(5)
    again["ema"] = torch.zeros(40)
    mgr = manager(tmp_path)
    try:
        assert mgr.restore(again) == 4
    finally:
        mgr.close()
    assert torch.equal(snapshot(again)["ema"], expected["ema"])
    assert torch.equal(snapshot(again)["model.0.weight"], expected["model.0.weight"])


def test_a_failed_save_gives_its_arena_back(tmp_path):
    state = make_state(0)
    mgr = manager(tmp_path)
    durable = tmp_path / "durable"
    try:
        for step in (1, 2, 3):
            train(state, range(step, step + 1))
            mgr.save(step, state)
            mgr.wait()
        blocker = durable / step_dir(4) / "__0_0.distcp"
        blocker.mkdir(parents=True)  # the upload of step 4's shard fails, after its local write
        mgr.save(4, state)
        with pytest.raises(ub.SaveFailedError, match="uploading"):
            mgr.wait()
        blocker.rmdir()
        assert 4 not in [c.step for c in mgr.checkpoints() if c.committed]
        assert not shard(tmp_path, 4).exists()
        held = mgr.stats.bytes_staged_in_place
        mgr.save(5, state)
        mgr.wait()
        assert mgr.stats.bytes_staged_in_place > held  # the failed save's arena, again
        assert len(arenas(tmp_path)) == 2
    finally:
        mgr.close()


def test_an_arena_is_free_only_while_no_snapshot_nor_step_holds_it(tmp_path):
    layout = lay_out([("w", (0,), torch.float32, (256,)), ("b", (0,), torch.float32, (4,))])
    pair = RankArenas(str(tmp_path), rank=3)
    assert pair.take(layout) is None  # take never makes one: the worker does, ahead
    pair.prepare(layout)
    first = pair.take(layout)
    assert first is not None and not first.free  # busy: its snapshot is staging
    views = first.views({"w": ((256,), torch.float32, False), "b": ((5,), torch.float32, False)})
    assert set(views) == {"w"}  # b's shape is not its slot's: it stages apart
    views["w"].fill_(2.0)
    pair.prepare(layout)  # one more while the first is held
    assert pair.take(layout) is not first
    first.link(str(tmp_path / "step-shard"))
    first.release()
    assert not first.free  # its step holds it now
    slot = layout.slots[0]
    data = (tmp_path / "step-shard").read_bytes()  # the staged bytes, where the slot says
    assert data[slot.payload_start : slot.payload_start + 4] == b"\x00\x00\x00\x40"
    pair.prepare(layout)
    assert len(os.listdir(tmp_path / ARENAS_DIR)) == 2  # never more than two
    os.unlink(tmp_path / "step-shard")
    assert first.free
    assert pair.take(layout) is first  # its step went: reused, same pages
    pair.close()
    assert not any(n.startswith("r3-") for n in os.listdir(tmp_path / ARENAS_DIR))


def test_a_view_outlives_its_arena_and_reads_no_other_saves_bytes(tmp_path):
    """A dropped arena gives its pages back at once; a view a released snapshot still
    holds stays mapped (no crash) and reads zeros, never another arena's bytes."""
    layout = lay_out([("w", (0,), torch.float32, (1024,))])
    pair = RankArenas(str(tmp_path), rank=0)
    pair.prepare(layout)
    arena = pair.take(layout)
    view = arena.views({"w": ((1024,), torch.float32, False)})["w"]
    view.fill_(1.5)
    arena.release()
    pair.prepare(lay_out([("w", (0,), torch.float32, (2048,))]))  # another layout: it goes
    assert not os.path.exists(arena.path)
    newer = pair.take(lay_out([("w", (0,), torch.float32, (2048,))]))
    newer.views({"w": ((2048,), torch.float32, False)})["w"].fill_(7.0)
    assert torch.equal(view, torch.zeros(1024))


def test_a_killed_ranks_arena_names_are_removed_by_its_successor(tmp_path):
    layout = lay_out([("w", (0,), torch.float32, (16,))])
    old = RankArenas(str(tmp_path), rank=0)
    old.prepare(layout)
    kept = old.take(layout)
    kept.link(str(tmp_path / "committed"))
    kept.release()
    old.prepare(layout)  # a second one, linked nowhere
    assert len(os.listdir(tmp_path / ARENAS_DIR)) == 2
    RankArenas(str(tmp_path), rank=1).prepare(layout)  # another live rank's stays
    dead = tmp_path / ARENAS_DIR / "r2-999999999-deadbeef"  # a rank of a process gone
    dead.write_bytes(b"x")
    RankArenas(str(tmp_path), rank=0)  # the restarted rank
    left = os.listdir(tmp_path / ARENAS_DIR)
    assert [n for n in left if not n.startswith("r1-")] == []
    assert len(left) == 1
    assert (tmp_path / "committed").stat().st_size == layout.end


def test_saves_queued_back_to_back_each_restore_their_own_values(tmp_path):
    """The next save stages while the one before still uploads (a slow remote): the arena
    that save was staged in is not handed out again, so every committed step, on the
    node and on the durable tier, holds its own values."""
    n = 2 << 20
    url = f"emulated::{tmp_path / 'durable'}"
    options = {"bandwidth": "20MB", "link": private_link("arena")}
    mgr = ub.CheckpointManager(
        url, staging_dir=tmp_path / "staging", memory_tier=True, keep_last=5,
        storage_options=options,
    )  # fmt: skip
    try:
        mgr.save(1, {"w": torch.full((n,), 1.0)})
        mgr.wait()  # its layout is known: the next saves stage in place
        for step in range(2, 6):
            mgr.save(step, {"w": torch.full((n,), float(step))})  # no wait between them
        mgr.wait()
        assert mgr.stats.committed == 5 and mgr.stats.bytes_staged_in_place > 0
        for step in (4, 5):  # the node keeps the newest; restore reads each file it lists
            got = {"w": torch.empty(n)}
            with ub.CheckpointManager(
                url, staging_dir=tmp_path / "other", memory_tier=False, storage_options=options
            ) as reader:
                assert reader.restore(got, step=step) == step
            assert torch.equal(got["w"], torch.full((n,), float(step))), step
        node = Path(mgr.memory_tier.path) / step_dir(5)
        flat = {"w": torch.empty(n)}
        dcp.load(flat, storage_reader=dcp.FileSystemReader(node), no_dist=True)
        assert torch.equal(flat["w"], torch.full((n,), 5.0))
    finally:
        mgr.close()


class _Holder:
    """A stateful whose state holds a tensor inside a tuple: DCP stores it as bytes."""

    def __init__(self) -> None:
        self.pair = (torch.arange(5), 1)

    def state_dict(self) -> dict:
        return {"pair": self.pair}

    def load_state_dict(self, sd: dict) -> None:
        self.pair = sd["pair"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_the_layout_is_the_one_the_writer_writes(tmp_path, dtype):
    """The writer's records sit where lay_out says, whatever the dtypes and sizes."""
    mgr = ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "staging")
    state = {
        "big": torch.ones(70_000, dtype=dtype),
        "small": torch.zeros(3, dtype=dtype),
        "empty": torch.zeros(0, dtype=dtype),
        "value": {"text": "x" * 100},
        "holder": _Holder(),
        "mod": nn.Linear(3, 2),
    }
    try:
        mgr.save(1, state)
        mgr.wait()
        layout = mgr._pipeline.node.layout
        reader = dcp.FileSystemReader(tier(tmp_path) / step_dir(1))
        where = {
            (i.fqn, tuple(i.offset or ())): info
            for i, info in reader.read_metadata().storage_data.items()
        }
    finally:
        mgr.close()
    assert layout is not None and {s.fqn for s in layout.slots} >= {"big", "small", "mod.weight"}
    for slot in layout.slots:
        info = where[(slot.fqn, slot.offset)]
        assert (info.offset, info.length) == (slot.start, slot.end - slot.start), slot.fqn
    placed = {(s.fqn, s.offset) for s in layout.slots}
    values = [info for key, info in where.items() if key not in placed]
    assert values and all(info.offset >= layout.end for info in values)  # after the tensors


def test_after_the_first_save_the_stager_no_longer_holds_what_the_arena_will(tmp_path):
    """The first save stages into private buffers; once its copy is in the tier and the
    next save's arena is made, those buffers go: two copies of the state in host memory
    (the committed one and the arena), not three, from the first save on."""
    torch.manual_seed(0)
    state = {"weights": torch.randn(1 << 20), "bias": torch.randn(1 << 18), "step": 0}
    mgr = manager(tmp_path)
    try:
        mgr.save(1, state)
        mgr.wait()
        pool = mgr._stager.pool
        assert "weights" not in pool and "bias" not in pool
        assert pool.nbytes < 4096  # at most the small values' segment
        state["weights"].add_(1.0)
        mgr.save(2, state)
        mgr.wait()
        assert mgr.stats.bytes_staged_in_place >= 5 << 20  # both tensors, in the arena
        assert pool.nbytes < 4096
        expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    finally:
        mgr.close()
    again = {"weights": torch.zeros(1 << 20), "bias": torch.zeros(1 << 18), "step": -1}
    mgr = manager(tmp_path)
    try:
        assert mgr.restore(again) == 2  # a clean end left the tier empty: durable
    finally:
        mgr.close()
    assert all(torch.equal(again[k], v) for k, v in expected.items())


def test_while_the_second_save_uploads_the_node_holds_two_copies_not_three(tmp_path):
    """After a save's local write the older step's copy is still in the tier until the
    commit: a spare arena made then would be a third copy of the state. It is made once
    the commit has tidied that step."""
    n = 2 << 20  # 8 MiB: about 0.4 s to upload at 20 MB/s
    url = f"emulated::{tmp_path / 'durable'}"
    options = {"bandwidth": "20MB", "link": private_link("arena-spare")}
    mgr = ub.CheckpointManager(
        url, staging_dir=tmp_path / "staging", memory_tier=True, storage_options=options
    )
    try:
        mgr.save(1, {"w": torch.full((n,), 1.0)})
        mgr.wait()
        assert len(arenas(tmp_path, url)) == 1  # the next save's, made once step 1 committed
        mgr.save(2, {"w": torch.full((n,), 2.0)})
        deadline = time.monotonic() + 30
        while not shard(tmp_path, 2, url).exists():  # step 2 written locally, now uploading
            assert time.monotonic() < deadline
            time.sleep(0.005)
        during = len(arenas(tmp_path, url))
        uploading = mgr.stats.committed == 1
        mgr.wait()
        assert uploading and during == 1  # step 1's copy and step 2's arena, no spare yet
        assert len(arenas(tmp_path, url)) == 2  # the spare, once step 1 has gone
        assert not (Path(mgr.memory_tier.path) / step_dir(1)).exists()
    finally:
        mgr.close()
