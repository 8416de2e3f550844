"""What restore refuses or skips before it touches the state: a checkpoint from a newer
unbroken (refused, and never deleted or overwritten), a checkpoint whose non-tensor parts
are wrong (the previous step instead, the file named), a step directory named otherwise
than unbroken names them (ignored, with a warning); and the manager's own inputs."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import unbroken as ub
from unbroken.checkpoint.errors import CheckpointCorruptError, NewerFormatError, SaveFailedError
from unbroken.checkpoint.format.manifest import step_dir

from .manager_util import assert_same, make_state, reseal, rng_draws, snapshot, train

RNG = "rng/rank-00000.json"
TIERS = ("durable", "staging")


def manager(tmp_path: Path, **kw) -> ub.CheckpointManager:
    kw.setdefault("every_steps", 2)
    kw.setdefault("when_busy", "wait")
    kw.setdefault("memory_tier", False)  # the local copy these tests damage is on disk
    return ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "staging", **kw)


def saved_run(tmp_path: Path, steps) -> dict[int, tuple[dict, list[float]]]:
    """A run that saved each of ``steps``: what each step holds and the RNG draws its
    restore must give next."""
    state, saved = make_state(), {}
    with manager(tmp_path) as mgr:
        for step in steps:
            train(state, [step])
            mgr.save(step, state)
            mgr.wait()
            saved[step] = snapshot(state), rng_draws()
    return saved


def trained_state() -> dict:
    """Another run's state, its optimizer stepped once (so that reading the state to
    restore it creates no optimizer state: what is compared is what restore changes)."""
    state = make_state(5)
    train(state, [1])
    return state


def step_bytes(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def rewrite(step: int, tmp_path: Path, name: str | None = None, data: bytes = b"", edit=None):
    """Change a committed step in both tiers the same way, its manifest resealed to match
    (so every checksum agrees and only the content is wrong)."""
    for tier in TIERS:
        path = tmp_path / tier / step_dir(step)
        if name is not None:
            (path / name).write_bytes(data)
        reseal(path, {name} if name else (), edit)


# -- a checkpoint written by a newer unbroken ------------------------------------------


def from_newer_unbroken(doc: dict) -> None:
    doc.update(format=2, library_version="9.0.0")


def test_a_checkpoint_from_a_newer_unbroken_is_refused_and_never_deleted_or_overwritten(
    tmp_path,
):
    saved_run(tmp_path, (2, 4))
    rewrite(4, tmp_path, edit=from_newer_unbroken)
    durable4 = tmp_path / "durable" / step_dir(4)
    before = step_bytes(durable4)
    fresh = trained_state()
    untouched = snapshot(fresh)
    refusal = (
        rf"step 4 was written by unbroken 9\.0\.0 \(format 2\); "
        rf"this is unbroken {re.escape(ub.__version__)}.*upgrade"
    )
    with manager(tmp_path, keep_last=1) as mgr:
        with pytest.raises(NewerFormatError, match=refusal) as info:
            mgr.restore(fresh)  # never the older step 2, whose next save would come to 4
        assert info.value.step == 4 and info.value.format == 2
        assert str(durable4) in str(info.value)
        with pytest.raises(NewerFormatError, match=refusal):
            mgr.restore(fresh, step=4)
        assert_same(snapshot(fresh), untouched)
        listed = {c.step: c for c in mgr.checkpoints()}
        assert not listed[4].committed and listed[4].newer_format
        assert re.search(refusal, listed[4].problem)
        # A run that starts over anyway: retention (keep_last=1) and the clean-up of
        # partial steps below the newest commit leave step 4 alone, and a later run's
        # save of step 4 is refused.
        for step in (6, 8):
            train(fresh, [step])
            mgr.save(step, fresh)
            mgr.wait()
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(4, fresh)
        with pytest.raises(SaveFailedError, match=refusal):
            mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [4, 8]
    assert step_bytes(durable4) == before


@pytest.mark.parametrize("flipped", ["3", "5", "9"])
def test_a_flipped_bit_in_the_format_field_falls_back_as_corrupt_not_newer(tmp_path, flipped):
    """One bit of ``"format": 1`` flipped (1 -> 3, 5 or 9) makes the record fail its own
    checksum: it is corrupt, not a checkpoint of a newer unbroken, so restore falls back to
    the previous step with a warning instead of refusing every restore."""
    saved = saved_run(tmp_path, (2, 4))
    path = tmp_path / "durable" / step_dir(4) / "manifest.json"
    data = path.read_bytes()
    assert data.count(b'"format": 1') == 1
    path.write_bytes(data.replace(b'"format": 1', f'"format": {flipped}'.encode()))
    fresh = make_state(5)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning) as record:
        assert mgr.restore(fresh) == 2
        listed = {c.step: c for c in mgr.checkpoints()}
    assert_same(snapshot(fresh), saved[2][0])
    messages = [str(w.message) for w in record]
    assert any(str(path) in m and "checksum" in m for m in messages), messages
    assert not listed[4].committed and not listed[4].newer_format


# -- what is not tensor bytes is checked before the state is touched ------------------


def rng_doc(tmp_path: Path, step: int) -> dict:
    return json.loads((tmp_path / "durable" / step_dir(step) / RNG).read_bytes())


def _missing_key(doc):
    doc.pop("numpy")
    return doc


def _position_past_the_end(doc):
    doc["python"]["internal"][-1] = 700  # random.setstate: "invalid state"
    return doc


def _cuda_state_of_the_wrong_size(doc):
    doc["cuda"] = ["AAAA"]
    return doc


BAD_RNG = {
    "a key missing": _missing_key,
    "a position past the end": _position_past_the_end,
    "a CUDA state of the wrong size": _cuda_state_of_the_wrong_size,
}


@pytest.mark.parametrize("case", [*sorted(BAD_RNG), "not JSON"])
def test_a_bad_rng_file_falls_back_to_the_previous_step_naming_the_file(tmp_path, case):
    saved = saved_run(tmp_path, (2, 4))
    doc = rng_doc(tmp_path, 4)
    data = b"{oops" if case == "not JSON" else json.dumps(BAD_RNG[case](doc)).encode()
    rewrite(4, tmp_path, RNG, data)
    fresh = make_state(5)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning) as record:
        assert mgr.restore(fresh) == 2
    expected, draws = saved[2]
    assert_same(snapshot(fresh), expected)
    assert rng_draws() == draws
    named = [str(w.message) for w in record if RNG in str(w.message)]
    assert named and all(step_dir(4) in m for m in named), [str(w.message) for w in record]


def test_a_bad_rng_file_with_nothing_to_fall_back_to_leaves_the_state_untouched(tmp_path):
    saved_run(tmp_path, (2,))
    rewrite(2, tmp_path, RNG, json.dumps(_missing_key(rng_doc(tmp_path, 2))).encode())
    fresh = trained_state()
    untouched = snapshot(fresh)
    with manager(tmp_path) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generators = generator_states()
        with pytest.raises(CheckpointCorruptError, match=re.escape(RNG)) as info:
            mgr.restore(fresh)
        assert generator_states() == generators
    assert "'numpy'" in str(info.value)
    assert_same(snapshot(fresh), untouched)


def generator_states() -> tuple:
    """Where the global generators are, without moving them."""
    import random

    import numpy as np
    import torch

    _, key, pos, *_ = np.random.get_state()
    return random.getstate(), key.tolist(), pos, torch.get_rng_state().tolist()


@pytest.mark.parametrize("values", ["epoch", ["epoch", "meta"], 3])
def test_plain_values_that_are_not_a_mapping_fall_back_naming_the_manifest(tmp_path, values):
    saved = saved_run(tmp_path, (2, 4))
    rewrite(4, tmp_path, edit=lambda doc: doc["extra"].update(values=values))
    fresh = make_state(5)
    with manager(tmp_path) as mgr, pytest.warns(RuntimeWarning) as record:
        assert mgr.restore(fresh) == 2
    assert_same(snapshot(fresh), saved[2][0])
    messages = [str(w.message) for w in record]
    assert any(
        "manifest.json" in m and step_dir(4) in m and "extra.values" in m for m in messages
    ), messages
    assert not any("another model" in m for m in messages)


# -- step directories unbroken did not name --------------------------------------------


def test_a_step_directory_with_a_non_canonical_name_is_ignored_with_a_warning(tmp_path):
    saved = saved_run(tmp_path, (2,))
    odd = tmp_path / "durable" / "step-0000000000099"  # 13 digits: not how 99 is written
    shutil.copytree(tmp_path / "durable" / step_dir(2), odd)
    reseal(odd, edit=lambda doc: doc.update(step=99))
    fresh = make_state(5)
    with manager(tmp_path, keep_last=1) as mgr:
        with pytest.warns(RuntimeWarning, match="step-0000000000099"):
            assert mgr.restore(fresh) == 2
        assert_same(snapshot(fresh), saved[2][0])
        with pytest.warns(RuntimeWarning, match="step-0000000000099"):
            assert [c.step for c in mgr.checkpoints()] == [2]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in (4, 6):  # retention runs, and never deletes what it did not name
                mgr.save(step, fresh)
                mgr.wait()
    assert (odd / "manifest.json").exists()


# -- the manager's own inputs, refused at construction ---------------------------------


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(tmp_path, timeout):
    with pytest.raises(ValueError, match="timeout"):
        manager(tmp_path, timeout=timeout)


@pytest.mark.parametrize("timeout", [-1.0, math.nan, "5"])
def test_wait_refuses_a_timeout_that_is_not_seconds_and_polls_with_zero(tmp_path, timeout):
    with manager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="wait: timeout"):
            mgr.wait(timeout)
        mgr.wait(0)  # nothing in flight: a poll returns


def test_a_staging_dir_that_is_a_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "staging"
    path.write_text("my notes")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        manager(tmp_path)
    assert path.read_text() == "my notes"


@pytest.mark.parametrize("where", ["the-file", "the-file/ckpt"])
def test_a_durable_path_that_is_a_file_or_under_one_is_refused_naming_it(tmp_path, where):
    """Else restore() finds nothing and the job trains from scratch, every save failing."""
    notes = tmp_path / "the-file"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match=re.escape(str(notes)) + " is a file"):
        ub.CheckpointManager(tmp_path / where, staging_dir=tmp_path / "staging")
    assert notes.read_text() == "my notes"


def test_a_durable_path_that_cannot_be_made_is_refused_when_the_manager_is_made(tmp_path):
    """/proc/ub (or a read-only mount) trained until the first due save, which failed
    with "create .../writer.json: not found": hundreds of steps lost at every_steps=500."""
    if os.geteuid() == 0:
        parent = Path("/proc")  # root makes directories anywhere permissions would stop it
    else:
        parent = tmp_path / "read-only"
        parent.mkdir()
        parent.chmod(0o500)
    with pytest.raises(ValueError, match=re.escape(str(parent / "ub")) + " cannot be created"):
        ub.CheckpointManager(parent / "ub", staging_dir=tmp_path / "staging")


def test_a_staging_dir_linked_to_nowhere_is_refused_naming_both(tmp_path):
    """A node-local scratch disk that is not mounted leaves the job's link dangling."""
    path = tmp_path / "staging"
    path.symlink_to(tmp_path / "scratch-not-mounted" / "ckpt")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*scratch-not-mounted.*not exist"):
        ub.CheckpointManager(tmp_path / "durable", staging_dir=path)
    assert not (tmp_path / "scratch-not-mounted").exists()


def test_an_unwritable_staging_dir_is_refused_naming_it(tmp_path):
    if os.geteuid() == 0:
        path = Path("/proc/self/fdinfo")  # root writes anywhere permissions would stop it
    else:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o500)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not writable"):
        ub.CheckpointManager(tmp_path / "durable", staging_dir=path)


# -- wait() covers the save's retention --------------------------------------------------


def test_wait_returns_once_the_saves_retention_is_done(tmp_path):
    durable = tmp_path / "durable"
    state = make_state()
    with ub.CheckpointManager(
        f"emulated::{durable}",
        staging_dir=tmp_path / "staging",
        keep_last=1,
        storage_options={"latency": 0.05, "bandwidth": None},
    ) as mgr:
        for step in (2, 4, 6):
            mgr.save(step, state)
            mgr.wait()
            committed = sorted(p.parent.name for p in durable.glob("step-*/manifest.json"))
            assert committed == [step_dir(step)]
        assert [c.step for c in mgr.checkpoints()] == [6]


def test_an_expanded_view_in_the_state_fails_the_restore_before_anything_changes(tmp_path):
    """A copy into an expand() view fails: the second pass raised after the model's
    weights were loaded, and the error blamed the checkpoint ("reading ... failed")."""
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "row": torch.ones(1, 4).expand(3, 4)}
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, state)
    with torch.no_grad():
        model.weight.zero_()
    refused = pytest.raises(ub.CheckpointMismatchError, match=r"entries row are views whose")
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr, refused:
        mgr.restore(state)
    assert not model.weight.any()  # untouched
    state["row"] = state["row"].clone()
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        assert mgr.restore(state) == 1
    assert model.weight.any()


def test_a_durable_tier_that_cannot_be_listed_fails_the_restore_as_a_checkpoint_error(tmp_path):
    """Rank 0 (the one listing) raised the store's bare RetriesExhaustedError, the other
    ranks the CheckpointError troubleshooting.md names: one error on every rank now."""
    import socket

    from unbroken.storage import RetriesExhaustedError, RetryPolicy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once it is closed
    retry = RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0)
    mgr = ub.CheckpointManager(
        f"http://127.0.0.1:{port}/run", staging_dir=tmp_path / "st", retry=retry,
        memory_tier=False, goodput=False,
    )  # fmt: skip
    with mgr, pytest.raises(ub.ListingFailedError, match=r"listing checkpoints at .* failed") as e:
        mgr.restore(make_state())
    assert isinstance(e.value.__cause__, RetriesExhaustedError)
    assert isinstance(e.value, ub.CheckpointError) and isinstance(e.value, ub.StoreError)


class LossHistory:
    """A user's object whose state_dict() grows in training: a tensor per step."""

    def __init__(self) -> None:
        self.hist: list[torch.Tensor] = []
        self.best: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {"hist": self.hist, "best": self.best}

    def load_state_dict(self, sd: dict) -> None:
        self.hist, self.best = list(sd["hist"]), dict(sd["best"])


def test_a_state_dict_that_grew_since_the_save_is_named_and_never_emptied_in_silence(tmp_path):
    model, history = torch.nn.Linear(3, 1), LossHistory()
    for step in range(1, 4):
        history.hist.append(torch.full((2,), float(step)))
        history.best[f"step{step}"] = torch.tensor(float(step))
    with manager(tmp_path) as mgr:
        mgr.save(3, {"model": model, "history": history})
    fresh, empty = torch.nn.Linear(3, 1), LossHistory()
    before = fresh.weight.detach().clone()
    state = {"model": fresh, "history": empty}
    with manager(tmp_path) as mgr:
        grew = r"state_dict\(\) of 'history' is laid out otherwise than when saved .*hist\.0"
        with pytest.raises(ub.CheckpointMismatchError, match=grew) as e:
            mgr.restore(state)
        assert "another model" not in str(e.value)
        assert torch.equal(fresh.weight, before)  # nothing loaded
        with pytest.warns(RuntimeWarning, match=r"strict=False without history\.best\.step1.* "
                          r"laid out otherwise") as w:  # fmt: skip
            assert mgr.restore(state, strict=False) == 3
        assert w[0].filename == __file__  # at the user's restore call
    assert torch.equal(fresh.weight, model.weight) and empty.hist == []
    # Given the saved layout, it loads whole.
    sized = LossHistory()
    sized.hist = [torch.zeros(2) for _ in range(3)]
    sized.best = {f"step{s}": torch.tensor(0.0) for s in range(1, 4)}
    with manager(tmp_path) as mgr:
        assert mgr.restore({"model": fresh, "history": sized}) == 3
    assert [float(t[0]) for t in sized.hist] == [1.0, 2.0, 3.0]


def test_strict_false_names_what_it_left_in_the_checkpoint(tmp_path):
    """A fine-tune from a bigger model: the part the state has is loaded, the rest named."""
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with manager(tmp_path) as mgr:
        mgr.save(2, {"model": big})
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match=r"without model\.2\.bias, model\.2\.weight, which"):
        assert ub.load(tmp_path / "durable", {"model": backbone}, strict=False) == 2
    assert torch.equal(backbone[0].weight, big[0].weight)
