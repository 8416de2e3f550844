"""DataLoader over a VolumeDataset: exactly once, seeded epochs, exact and elastic resume."""

from __future__ import annotations

import copy
import pickle
import random
import time
from collections import Counter

import numpy as np
import pytest
import torch

from tests.data.conftest import decode_augmented
from tests.data.helpers import check_save_load, flatten, same_state, serve
from unbroken.data.loader_state import LoaderStateError


def test_each_sample_once_per_epoch_across_ranks_and_workers(make_volume, backend):
    vol = make_volume(26, backend)
    ranks = vol.ranks(3, batch_size=2, num_workers=2, seed=5)
    epochs = [serve(ranks) for _ in range(2)]
    for seen in epochs:
        flat = [s for rank in seen for s in rank]
        assert len(flat) == 24  # 26 files, global batch 6: tail of 2 dropped on every rank
        assert len(set(flat)) == 24
        assert all(len(rank) == 8 for rank in seen)
    assert epochs[0] != epochs[1]  # seeded order changes per epoch
    assert [ld.epoch for ld in ranks] == [1, 1, 1]
    assert same_state(ranks)["epoch"] == 2 and same_state(ranks)["position"] == 0


def test_order_depends_on_seed_and_epoch_not_on_workers(make_volume):
    vol = make_volume(20)
    runs = {}
    for workers in (0, 1, 2):
        ld = vol.loader(batch_size=3, num_workers=workers, seed=11, drop_last=False)
        runs[workers] = [flatten(b) for epoch in range(2) for b in ld]
    assert runs[0] == runs[1] == runs[2]
    other_seed = vol.loader(batch_size=3, seed=12, drop_last=False)
    assert [flatten(b) for b in other_seed] != runs[0][: len(other_seed)]
    unshuffled = vol.loader(batch_size=4, shuffle=False)
    assert [s for b in unshuffled for s in flatten(b)] == [
        s for b in unshuffled for s in flatten(b)
    ]


def test_tail_served_smaller_when_asked(make_volume):
    vol = make_volume(11)
    batches = [flatten(b) for b in vol.loader(batch_size=4, drop_last=False)]
    assert [len(b) for b in batches] == [4, 4, 3]
    assert sorted(s for b in batches for s in b) == list(range(11))
    with pytest.raises(ValueError, match="do not fill one global batch of 12"):
        vol.loader(batch_size=4, rank=0, world_size=3)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"world_size": 2, "num_workers": 2}, {"world_size": 2, "num_workers": 1}),
        ({"world_size": 2, "num_workers": 1}, {"world_size": 3, "num_workers": 2}),
        ({"world_size": 3, "num_workers": 0}, {"world_size": 1, "num_workers": 2}),
    ],
    ids=["other-workers", "grow-world", "shrink-world"],
)
def test_mid_epoch_resume_serves_the_rest_exactly_once(make_volume, backend, before, after):
    vol = make_volume(30, backend)

    def job(world_size, num_workers):
        return lambda: vol.ranks(world_size, batch_size=2, num_workers=num_workers, seed=4)

    run = check_save_load(job(**before), job(**after), stop_after=3)
    g_before = 2 * before["world_size"]
    assert run.state["epoch"] == 0 and run.state["position"] == 3 * g_before
    assert sum(map(len, run.before)) == 3 * g_before
    g_after = 2 * after["world_size"]
    rest = 30 - run.state["position"]
    assert sum(map(len, run.after)) == rest - rest % g_after
    if before["world_size"] == after["world_size"]:  # same job shape: same samples, same order
        full = serve(job(**after)())
        assert [b + a for b, a in zip(run.before, run.after)] == full


def test_augmentation_identical_across_resume(make_volume):
    vol = make_volume(24)

    def job(world_size, workers):
        return lambda: vol.ranks(
            world_size, batch_size=2, num_workers=workers, decode=decode_augmented, seed=9
        )

    uninterrupted = {s[0]: s for rank in serve(job(2, 1)()) for s in rank}
    run = check_save_load(job(2, 1), job(3, 2), stop_after=2, key=lambda s: s[0])
    resumed = {s[0]: s for s in run.all_samples}
    assert resumed == {k: uninterrupted[k] for k in resumed}
    assert len({s[1] for s in resumed.values()}) == len(resumed)  # draws differ per sample


def _mixup(items: list) -> tuple:
    """A batch-level augmentation: a mixup's draws, one from each global RNG."""
    return items, torch.rand(()).item(), float(np.random.rand()), random.random()


def test_collate_draws_are_the_same_across_resume_and_worker_counts(make_volume):
    """A resumed run's workers started their RNG streams over: batch 5's mixup drew what
    batch 0's had, batch 6 what batch 1's had."""
    vol = make_volume(24)

    def loader(workers: int):
        return vol.loader(batch_size=2, num_workers=workers, seed=3, collate_fn=_mixup)

    full = list(loader(2))
    first = loader(2)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    del it
    resumed = loader(1)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert len({b[1] for b in full}) == len(full)  # each batch draws its own
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    assert list(loader(0)) == full  # in the training process: the same draws,
    assert torch.equal(torch.rand(2), expected)  # and the loop's RNG left where it was


def test_state_at_epoch_end_resumes_at_next_epoch(make_volume):
    vol = make_volume(12)
    ld = vol.loader(batch_size=4, num_workers=1, seed=1)
    it = iter(ld)
    epoch0 = [flatten(next(it)) for _ in range(3)]  # the last batch; StopIteration not yet seen
    state = ld.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    reference = vol.loader(batch_size=4, seed=1)
    ref_epochs = [[flatten(b) for b in reference] for _ in range(2)]
    assert epoch0 == ref_epochs[0]
    resumed = vol.loader(batch_size=4, num_workers=2, seed=1)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1  # the epoch the next iteration serves
    assert [flatten(b) for b in resumed] == ref_epochs[1]
    assert resumed.epoch == 1


def test_position_counts_consumed_batches_not_prefetched_ones(make_volume):
    vol = make_volume(40)
    ld = vol.loader(batch_size=2, num_workers=2, seed=3)
    it = iter(ld)
    next(it)
    next(it)
    import time

    time.sleep(0.5)  # let the workers run far ahead
    assert ld.state_dict()["position"] == 4
    first_two_more = [flatten(next(it)) for _ in range(2)]
    resumed = vol.loader(batch_size=2, num_workers=0, seed=3)
    resumed.load_state_dict({**ld.state_dict(), "position": 4})
    it2 = iter(resumed)
    assert [flatten(next(it2)) for _ in range(2)] == first_two_more


@pytest.mark.parametrize("persistent", [True, False])
def test_load_state_mid_iteration_restarts_workers(make_volume, persistent):
    vol = make_volume(20)
    ld = vol.loader(batch_size=2, num_workers=2, seed=2, persistent_workers=persistent)
    reference = [flatten(b) for b in vol.loader(batch_size=2, seed=2)]
    it = iter(ld)
    first = [flatten(next(it)) for _ in range(2)]
    state = ld.state_dict()
    [next(it) for _ in range(4)]  # go further, then jump back
    ld.load_state_dict(state)
    assert ld.state_dict() == state
    rest = [flatten(b) for b in it]  # the same for loop continues from the loaded position
    assert first + rest == reference
    assert ld.state_dict()["epoch"] == 1


def test_second_resume_does_not_reset_the_position(make_volume):
    vol = make_volume(24)
    reference = [flatten(b) for b in vol.loader(batch_size=2, seed=8)]
    ld = vol.loader(batch_size=2, num_workers=1, seed=8)
    it = iter(ld)
    got = [flatten(next(it)) for _ in range(3)]
    for _ in range(2):  # two restarts in a row, each continuing where the last stopped
        ld2 = vol.loader(batch_size=2, num_workers=2, seed=8)
        ld2.load_state_dict(ld.state_dict())
        it = iter(ld2)
        got += [flatten(next(it)) for _ in range(3)]
        ld = ld2
    got += [flatten(b) for b in it]
    assert got == reference


def test_bad_states_are_refused_by_name(make_volume):
    vol = make_volume(10)
    ld = vol.loader(batch_size=2)
    state = ld.state_dict()
    other = make_volume(11).loader(batch_size=2)
    with pytest.raises(LoaderStateError, match=r"saved index fingerprint \w+ \(11 files\)"):
        ld.load_state_dict(other.state_dict())
    with pytest.raises(LoaderStateError, match="saved seed=1 but this dataset has seed=0"):
        ld.load_state_dict({**state, "seed": 1})
    with pytest.raises(LoaderStateError, match=r"lacks \['position'\]"):
        ld.load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(LoaderStateError, match="position 99 is past the 10 files"):
        ld.load_state_dict({**state, "position": 99})
    with pytest.raises(LoaderStateError, match="bad epoch -1"):
        ld.load_state_dict({**state, "epoch": -1})
    for key, bad in [
        ("epoch", 2**70), ("epoch", 2**63), ("epoch", "1"), ("epoch", True),
        ("position", -2), ("position", 11), ("position", 2.0), ("position", None),
        ("num_samples", "10"), ("num_samples", 9), ("format", True), ("shuffle", 1),
    ]:  # fmt: skip
        with pytest.raises(LoaderStateError, match=key):
            ld.load_state_dict({**state, key: bad})
    assert ld.state_dict() == state  # nothing changed by the refused loads
    assert next(iter(ld)) is not None  # and the loader still serves
    import json

    assert json.loads(json.dumps(state)) == state


def test_loader_does_not_touch_the_training_loops_rng(make_volume):
    vol = make_volume(12)
    for workers in (0, 2):
        ld = vol.loader(batch_size=2, num_workers=workers, decode=decode_augmented)
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        expected = (torch.rand(3), np.random.rand(3), random.random())
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        for _ in range(2):
            for _batch in ld:
                pass
        got = (torch.rand(3), np.random.rand(3), random.random())
        assert torch.equal(got[0], expected[0])
        assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_breaking_out_starts_the_next_epoch(make_volume):
    vol = make_volume(12)
    ld = vol.loader(batch_size=2, num_workers=1, seed=6)
    for _ in ld:
        break
    assert ld.state_dict()["position"] == 2 and ld.epoch == 0  # a save here resumes here
    second = [flatten(b) for b in ld]
    assert ld.epoch == 1
    reference = vol.loader(batch_size=2, seed=6)
    list(reference)
    assert second == [flatten(b) for b in reference]
    with pytest.raises(RuntimeError, match="superseded"):
        it1 = iter(ld)
        next(it1)
        it2 = iter(ld)
        next(it2)
        next(it1)


def test_leaving_an_epoch_whose_position_was_saved_says_what_a_resume_would_serve(
    make_volume, caplog
):
    vol = make_volume(12)
    ld = vol.loader(batch_size=2, seed=6)
    for i, _ in enumerate(ld):
        if i == 1:
            ld.state_dict()  # a save inside the loop
            break
    with caplog.at_level("WARNING", logger="unbroken.data.loader"):
        list(ld)
    assert "epoch 0 was left at position 4 of 12 for epoch 1" in caplog.text
    assert "loader.end_epoch()" in caplog.text
    caplog.clear()
    for i, _ in enumerate(ld):  # no state taken in epoch 1: nothing to say
        if i == 1:
            break
    for _, _ in zip(range(len(ld)), ld):  # served to its end, never seeing StopIteration
        ld.state_dict()
    with caplog.at_level("WARNING", logger="unbroken.data.loader"):
        list(ld)
        for i, _ in enumerate(ld):  # a state taken, then end_epoch: said nowhere either
            if i == 1:
                ld.end_epoch()
                ld.state_dict()
        list(ld)
    assert caplog.text == ""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_that_ends_its_epochs_early_resumes_as_it_went_on(make_volume, workers):
    """3 batches an epoch, a save at each epoch's last batch, still inside the ``for``."""
    vol = make_volume(20)

    def run(loader, epochs):
        seen, states = [], []
        for _ in range(epochs):
            for i, batch in enumerate(loader):
                seen.append((loader.epoch, flatten(batch)))
                if i == 2:
                    loader.end_epoch()
                    states.append(loader.state_dict())
                    break
        return seen, states

    live, states = run(vol.loader(batch_size=2, num_workers=workers, seed=5), 3)
    assert [s["epoch"] for s in states] == [1, 2, 3]
    assert [e for e, _ in live] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    resumed = vol.loader(batch_size=2, num_workers=workers, seed=5)
    resumed.load_state_dict(states[0])  # saved at epoch 0's third batch
    assert run(resumed, 2)[0] == live[3:]
    it = iter(resumed)
    reference = vol.loader(batch_size=2, seed=5)
    epoch3_first = [[flatten(b) for b in reference] for _ in range(4)][3][0]
    assert flatten(next(it)) == epoch3_first and resumed.epoch == 3
    resumed.end_epoch()  # the iterator stops at once
    assert list(it) == [] and resumed.state_dict()["epoch"] == 4
    fresh = vol.loader(batch_size=2, seed=5)
    fresh.end_epoch()  # before any batch: nothing to end
    assert fresh.state_dict()["epoch"] == 0


def test_metrics_count_waits_and_worker_work(make_volume, backend):
    vol = make_volume(16, backend)
    ld = vol.loader(batch_size=4, num_workers=2)
    list(ld)
    m = ld.metrics
    assert m.batches == 4 and len(m.batch_fetch_seconds) == 4
    assert m.fetch_seconds >= sum(m.batch_fetch_seconds) * 0.999
    assert m.samples == 16 and m.decode_seconds > 0
    assert m.misses == 16 and m.bytes_fetched == sum(len(str(i)) for i in range(16))
    list(ld)
    assert m.hits >= 16 and m.misses == 16
    assert set(Counter(m.snapshot())) >= {"fetch_seconds", "hits", "misses", "retries"}


@pytest.mark.multiprocess
def test_spawned_persistent_workers_follow_epochs_and_restarts(make_volume):
    vol = make_volume(16)
    ld = vol.loader(batch_size=2, num_workers=1, seed=4, multiprocessing_context="spawn")
    assert len(ld) == 8
    reference = vol.loader(batch_size=2, seed=4)
    expected = [[flatten(b) for b in reference] for _ in range(2)]
    assert [flatten(b) for b in ld] == expected[0]
    it = iter(ld)  # epoch 1, in the same spawned worker
    got = [flatten(next(it)) for _ in range(3)]
    state = ld.state_dict()
    next(it)
    ld.load_state_dict(state)  # jump back: the spawned worker restarts at the position
    got += [flatten(b) for b in it]
    assert got == expected[1]


def test_dataset_alone_works_with_a_stock_torch_dataloader(make_volume):
    vol = make_volume(14)
    shards = []
    for rank in range(2):
        ds = vol.dataset(rank=rank, world_size=2, seed=2)
        ds.epoch = 1
        stock = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        shards.append(list(stock))
    assert sorted(shards[0] + shards[1]) == list(range(14))
    assert len(shards[0]) == len(shards[1]) == 7


@pytest.mark.parametrize(
    ("context", "copied"),
    [("fork", None), ("spawn", None), ("fork", "pickle"), ("fork", "deepcopy")],
)
def test_a_stock_dataloaders_persistent_workers_see_each_epoch_the_loop_sets(
    make_volume, context, copied
):
    # persistent workers keep the copy of the dataset they started with: the epoch must
    # reach them anyway, or every epoch repeats the first one's order and augmentations.
    # A dataset shipped to this process (pickled, as Ray or submitit do) too.
    vol = make_volume(12)
    ds, fresh = vol.dataset(seed=3), vol.dataset(seed=3)
    if copied == "pickle":
        ds = pickle.loads(pickle.dumps(ds))
    elif copied == "deepcopy":
        ds = copy.deepcopy(ds)

    def loader(dataset, persistent):
        return torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=2, persistent_workers=persistent,
            multiprocessing_context=context,
        )  # fmt: skip

    stock = loader(ds, persistent=True)
    served = []
    for epoch in (0, 1, 2, 1):
        if epoch == 1:
            ds.set_epoch(epoch)  # the name samplers use
        else:
            ds.epoch = epoch
        fresh.epoch = epoch  # workers started anew each epoch: what it must serve
        served.append(list(stock))
        assert served[-1] == list(loader(fresh, persistent=False)), epoch
    assert len({tuple(s) for s in served}) == 3  # three epochs, three orders


def test_a_bad_epoch_is_refused_by_name(make_volume):
    ds = make_volume(4).dataset()
    for bad in (-1, 1.5, "1", True, None):
        with pytest.raises(ValueError, match="epoch must be an int >= 0"):
            ds.epoch = bad
    ds.epoch = np.int64(2)
    assert ds.epoch == 2


def test_a_resume_at_another_global_batch_says_how_many_samples_its_tail_drops(
    make_volume, caplog
):
    """40 files, stopped at 28 with a global batch of 4, resumed with one of 8: the 12
    left fill one batch of 8, and 4 samples of the epoch were never served, unsaid."""
    vol = make_volume(40)
    first = vol.loader(batch_size=4, seed=1)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    del it
    again = vol.ranks(2, batch_size=4, seed=1)
    with caplog.at_level("WARNING", logger="unbroken.data.loader"):
        for ld in again:
            ld.load_state_dict(state)
    assert "position 28 of the epoch with a global batch of 8" in caplog.text
    assert "last 4 samples do not fill a batch" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="unbroken.data.loader"):
        vol.loader(batch_size=4, seed=1).load_state_dict(state)  # the same shape: no word
    assert "do not fill" not in caplog.text


def test_after_a_resume_whose_epoch_has_no_batch_left_the_loader_names_the_next_epoch(
    make_volume,
):
    """Saved at 20 of 24 files with batches of 2, resumed with batches of 6: the rest of
    epoch 0 holds no batch, so the first loop serves epoch 1. loader.epoch said 0, and a
    loop ``for e in range(loader.epoch, E)`` trained one epoch more than E."""
    vol = make_volume(24)
    first = vol.loader(batch_size=2)
    it = iter(first)
    for _ in range(10):
        next(it)
    state = first.state_dict()
    del it
    resumed = vol.loader(batch_size=6)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    next(iter(resumed))
    assert resumed.epoch == 1


def test_the_loop_waiting_for_an_epochs_start_counts_as_waiting_for_data(make_volume, monkeypatch):
    """Starting an epoch (forking its workers: 40-50 ms in a hostile user's run) ran
    before the timed wait for the first batch, so goodput counted it as productive."""
    from unbroken.data.loader import DataLoader

    plan = DataLoader._write_plan

    def slow_plan(self, epoch: int, start: int) -> None:
        time.sleep(0.3)  # a start that takes its time, whatever the part
        plan(self, epoch, start)

    monkeypatch.setattr(DataLoader, "_write_plan", slow_plan)
    loader = make_volume(8).loader(batch_size=2)
    next(iter(loader))
    assert loader.metrics.batch_fetch_seconds[0] >= 0.3
