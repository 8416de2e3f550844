"""What a rank concludes when the commit's outcome never reaches it (a peer died)."""

from __future__ import annotations

import unbroken as ub
from unbroken.checkpoint.format.manifest import FileRecord, new_manifest, write_manifest
from unbroken.checkpoint.save_phases import recorded_outcome

MINE = [FileRecord("__1_0.distcp", 20, 7), FileRecord("rng/rank-00001.json", 5, 9)]
THEIRS = [FileRecord("__0_0.distcp", 20, 3), FileRecord("rng/rank-00000.json", 5, 4)]


def test_the_step_stands_only_where_its_record_holds_this_ranks_files_as_uploaded(tmp_path):
    store = ub.open_store(str(tmp_path / "d"))
    assert recorded_outcome(store, 4, MINE, None) is None  # no record: not committed
    write_manifest(store, new_manifest(4, 2, [*THEIRS, *MINE]))
    kind, manifest = recorded_outcome(store, 4, MINE, None)
    assert kind == "ok" and b'"__1_0.distcp"' in manifest
    other_bytes = [FileRecord("__1_0.distcp", 20, 8), MINE[1]]  # another save's record
    assert recorded_outcome(store, 4, other_bytes, None) is None
    assert recorded_outcome(store, 4, [], None) is None  # nothing to go by
    # the coordinator knows its own outcome
    assert recorded_outcome(store, 9, MINE, ("ok", b"{}")) == ("ok", b"{}")
    assert recorded_outcome(store, 4, MINE, ("error", "step 4 not committed")) is None


def test_a_store_that_is_down_answers_none_within_its_quick_policy(tmp_path):
    switch = tmp_path / "outage"
    switch.write_text("down")
    opts = {"latency": 0, "bandwidth": None, "outage_file": str(switch)}
    store = ub.open_store("emulated::" + str(tmp_path / "d"), **opts)
    quick = store.with_retry(ub.RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.05))
    assert quick.retry.max_attempts == 2 and store.retry.max_attempts == 10  # a copy
    assert recorded_outcome(quick, 4, MINE, None) is None
    assert quick.stats.retries == 1  # two attempts, not the store's own ten
