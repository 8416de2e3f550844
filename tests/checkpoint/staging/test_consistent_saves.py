"""Saves through the manager as ordinary training code makes them: a model-only state with
its optimizer outside, writes through ``.data`` (EMA, clipping) right after ``save()``.

Each save is either committed with the values of one moment or abandoned and reported;
never committed with mixed values, and no save is lost to an optimizer the state does not
hold."""

from __future__ import annotations

import warnings

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

import unbroken as ub
from unbroken.checkpoint.errors import SaveFailedError
from unbroken.checkpoint.staging import step_gate

WIDTH = 1024


def _layers(n: int = 16) -> nn.Module:
    """n x 1024^2 linear layers (4 MiB of weight each): the copy outlasts a forward/backward."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n)])


def _manager(tmp_path, **kw) -> ub.CheckpointManager:
    return ub.CheckpointManager(
        str(tmp_path / "durable"), staging_dir=str(tmp_path / "staging"), every_steps=1, **kw
    )


def _restored(mgr: ub.CheckpointManager, step: int, n: int) -> dict[str, torch.Tensor]:
    fresh = _layers(n)
    for p in fresh.parameters():
        p.data.zero_()
    assert mgr.restore({"model": fresh}, step=step) == step
    return {k: v.clone() for k, v in fresh.state_dict().items()}


def test_an_optimizer_outside_a_model_only_state_loses_no_save(tmp_path):
    """A plain loop that saves at the top of its update: ``state = {"model": model}``,
    SGD kept by the user, its step() right after save(). Every step() waits for a copy
    in flight, whoever holds the optimizer, so no save is torn."""
    model = _layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, WIDTH)
    saved = {}
    # Recorded, not raised: warning filters are process-wide, and "error" would also turn
    # DCP's own warnings in the save's background thread into failures.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _manager(tmp_path) as mgr:
            for step in range(1, 5):
                opt.zero_grad()
                model(x).square().mean().backward()
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
                assert mgr.save(step, {"model": model})
                opt.step()  # the copy of 64 MiB has only just begun
            mgr.wait()
            assert mgr.stats.failed == 0 and mgr.stats.committed == 4, mgr.failures
            for step in (2, 4):  # keep_last=3
                got = _restored(mgr, step, 16)
                for key, value in saved[step].items():
                    assert torch.equal(got[key], value), (step, key)
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert not failed, failed  # a torn save would be warned about at the next save


def _mixed(got: dict[str, torch.Tensor], old: dict[str, torch.Tensor], value: float) -> list:
    """Keys holding the old values and keys holding the write; both non-empty = mixed."""
    as_old = [k for k in got if torch.equal(got[k], old[k])]
    as_new = [k for k in got if bool((got[k] == value).all())]
    torn_within = [k for k in got if k not in as_old and k not in as_new]
    assert not torn_within, f"tensors part old, part written: {torn_within}"
    return [as_old, as_new] if as_old and as_new else []


def test_a_write_through_data_right_after_save_never_commits_mixed_values(tmp_path):
    """What an EMA or weight clipping through ``.data`` does: ``_version`` does not move.
    The copy is checked against its sources once it ends, so a save is committed with one
    moment's values or abandoned and reported, naming nothing the user cannot reach."""
    model = _layers()
    outcomes = []
    with _manager(tmp_path) as mgr:
        for step in range(1, 4):
            old = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(step, {"model": model})
            for p in model.parameters():
                p.data.fill_(float(step))
            try:
                mgr.wait()
            except SaveFailedError as exc:
                text = str(exc)
                assert "torn" in text and "'model." in text, text
                assert "attach" not in text and "StateStager" not in text, text
                assert "first=" not in text, text
                assert ".data" in text and "optimizer.step()" in text, text
                outcomes.append("abandoned")
                continue
            got = _restored(mgr, step, 16)
            assert not _mixed(got, old, float(step)), f"step {step} committed mixed values"
            outcomes.append("committed")
    assert outcomes, outcomes


def test_one_global_step_hook_for_every_manager_removed_when_the_last_closes(tmp_path):
    def ours() -> int:
        hooks = optimizer_module._global_optimizer_pre_hooks.values()
        return sum(hook is step_gate._before_step for hook in hooks)

    already = step_gate.open_stagers()  # managers other tests left open, if any
    first = _manager(tmp_path / "a")
    second = _manager(tmp_path / "b")
    assert ours() == 1 and step_gate.open_stagers() == already + 2
    first.save(1, {"model": nn.Linear(4, 4)})
    first.close()
    assert ours() == 1  # the second manager still needs it
    second.close()
    second.close()  # closing again changes nothing
    assert step_gate.open_stagers() == already
    assert ours() == (1 if already else 0)
