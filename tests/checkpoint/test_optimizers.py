"""Every optimizer and LR scheduler torch ships round-trips through ub.CheckpointManager.

The classes are discovered from ``torch.optim`` and ``torch.optim.lr_scheduler``, so a new
one is covered the day torch adds it: built from the tables below when it needs arguments,
with defaults otherwise, and a class neither can build fails its case (never skipped).
Each case trains a few steps, saves, trains on; a fresh model/optimizer/scheduler with other
weights restores and trains the same steps: the two must end bitwise equal, and equal to a
run that never had a manager at all (neither a save nor a restore that found nothing may
change training). Also here: the other things that shape training (tied weights,
non-persistent buffers, bf16, GradScaler, Generator, any state_dict object) and a restore
that fails part-way leaving the model as it was.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler

import unbroken as ub
from unbroken.checkpoint.errors import CheckpointMismatchError
from unbroken.checkpoint.format import reader

VOCAB = 10


class Net(nn.Module):
    """An embedding (sparse for SparseAdam), two linears, a BatchNorm, a scalar parameter."""

    def __init__(self, *, sparse: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, sparse=sparse)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, VOCAB if tied else 2)
        if tied:
            self.out.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.ones(()))  # a 0-d parameter: its state is too

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.lin(self.emb(idx))) * self.temperature))


def _matrices(model: Net) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim == 2]


# Optimizers that need arguments or parameters of one kind; every other class of
# torch.optim is built as cls(model.parameters()).
OPTIMIZERS: dict[str, Callable[[Net], torch.optim.Optimizer]] = {
    "SGD-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "Adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
    "LBFGS": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3, history_size=4),
    "Muon": lambda m: torch.optim.Muon(_matrices(m), lr=0.02),  # 2-d parameters only
    "SparseAdam": lambda m: torch.optim.SparseAdam(m.emb.parameters(), lr=0.1),
}
SPARSE = {"SparseAdam"}  # needs the sparse-gradient embedding


def _discovered(module: Any, base: type, exclude: set[str]) -> list[str]:
    return sorted(
        name
        for name, cls in vars(module).items()
        if inspect.isclass(cls)
        and issubclass(cls, base)
        and not name.startswith("_")
        and name not in exclude
    )


OPTIMIZER_NAMES = sorted(
    set(_discovered(torch.optim, torch.optim.Optimizer, {"Optimizer"})) | set(OPTIMIZERS)
)


def build_optimizer(name: str, model: Net) -> torch.optim.Optimizer:
    if name in OPTIMIZERS:
        return OPTIMIZERS[name](model)
    try:
        return getattr(torch.optim, name)(model.parameters())
    except Exception as e:
        pytest.fail(f"torch.optim.{name} cannot be built with defaults ({e}): add it to OPTIMIZERS")


def _chain(o: torch.optim.Optimizer) -> list[lr_scheduler.LRScheduler]:
    return [
        lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
        lr_scheduler.ExponentialLR(o, gamma=0.9),
    ]


# Schedulers that need arguments; every other class is built as cls(optimizer).
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lr_lambda=lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lr_lambda=lambda e: 0.95),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lr_scheduler.MultiStepLR(o, milestones=[2, 4], gamma=0.5),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(o, _chain(o), milestones=[2]),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(_chain(o), optimizer=o),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
}

SCHEDULER_NAMES = sorted(
    set(
        _discovered(lr_scheduler, lr_scheduler.LRScheduler, {"LRScheduler"})
        + _discovered(lr_scheduler, lr_scheduler.ReduceLROnPlateau, set())
    )
    | set(SCHEDULERS)
)


def build_scheduler(name: str, optim: torch.optim.Optimizer) -> Any:
    if name in SCHEDULERS:
        return SCHEDULERS[name](optim)
    try:
        return getattr(lr_scheduler, name)(optim)
    except Exception as e:
        pytest.fail(
            f"torch.optim.lr_scheduler.{name} cannot be built with defaults ({e}): "
            "add it to SCHEDULERS"
        )


def train(state: dict, steps: range) -> None:
    """Each step's batch comes from the step number alone, so two runs see the same data."""
    model, optim = state["model"], state["optim"]
    sched, scaler = state.get("sched"), state.get("scaler")
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, VOCAB, (8,), generator=g)
        target = torch.randn(8, model.out.out_features, generator=g)
        if "gen" in state:  # the user's own generator shapes training (a noise draw)
            target = target + torch.randn(target.shape, generator=state["gen"])

        def closure(idx: torch.Tensor = idx, target: torch.Tensor = target) -> torch.Tensor:
            optim.zero_grad()
            out = model(idx)
            loss = F.mse_loss(out, target.to(out.dtype))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            return loss

        if scaler is not None:
            loss = closure()
            scaler.step(optim)
            scaler.update()
        else:
            loss = optim.step(closure)
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(float(loss.detach()))
        elif sched is not None:
            sched.step()


def snapshot(state: dict) -> dict:
    """Everything training depends on, copied, for a bitwise comparison."""
    out: dict[str, Any] = {"model": state["model"].state_dict()}
    for name, value in state.items():
        if name != "model" and hasattr(value, "state_dict"):
            out[name] = value.state_dict()
    if "gen" in state:
        out["gen"] = state["gen"].get_state()
    return copy.deepcopy(out)


def assert_bitwise(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        assert torch.equal(
            a.view(torch.uint8) if a.ndim else a, b.view(torch.uint8) if b.ndim else b
        ), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def check_resumes_bitwise(
    tmp_path: Path,
    build: Callable[[int], dict],
    *,
    save_at: int = 3,
    after: int = 3,
    async_save: bool = True,
) -> None:
    """Train ``save_at`` steps, save, train ``after`` more; a fresh state restored from the
    save must end bitwise where that run (and a run without a manager) ended."""
    total = range(save_at + after)
    never_saved = build(0)
    train(never_saved, total)
    expected = snapshot(never_saved)

    live = build(0)
    with ub.CheckpointManager(
        tmp_path / "durable", staging_dir=tmp_path / "staging", async_save=async_save
    ) as mgr:
        assert mgr.restore(live) is None  # nothing to restore: must leave the job as it is
        train(live, range(save_at))
        assert mgr.save(save_at, live)
        train(live, range(save_at, total.stop))  # async: the next steps race the save
        mgr.wait()
        assert_bitwise(snapshot(live), expected, "live")

        resumed = build(1)  # other initial weights: everything must come from the checkpoint
        assert mgr.restore(resumed) == save_at
        train(resumed, range(save_at, total.stop))
        assert_bitwise(snapshot(resumed), expected, "resumed")


def _optimizer_state(name: str) -> Callable[[int], dict]:
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net(sparse=name in SPARSE)
        return {"model": model, "optim": build_optimizer(name, model)}

    return build


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_resumes_bitwise(tmp_path, name):
    check_resumes_bitwise(tmp_path, _optimizer_state(name))


@pytest.mark.parametrize("name", ["SGD", "Adam", "Rprop", "LBFGS", "SparseAdam"])
def test_saved_before_the_first_step(tmp_path, name):
    """No per-parameter state yet: the restored optimizer must have none either (a fresh
    one's first step makes it), whatever state the optimizer restored into had."""
    check_resumes_bitwise(tmp_path, _optimizer_state(name), save_at=0, async_save=False)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_lr_scheduler_resumes_bitwise(tmp_path, name):
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {"model": model, "optim": optim, "sched": build_scheduler(name, optim)}

    check_resumes_bitwise(tmp_path, build, async_save=name != "StepLR")


def test_plain_sgd_restores(tmp_path):
    """Issue 20.1: plain SGD has an empty state; restore used to fail inside torch."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        fresh = nn.Linear(3, 2)
        fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.7)
        assert mgr.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_optim.param_groups[0]["lr"] == 0.1
    assert fresh_optim.state_dict()["state"] == {}


def test_tied_weights_stay_tied(tmp_path):
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net(tied=True)
        return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}

    check_resumes_bitwise(tmp_path, build)
    state = build(2)
    with ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "staging") as mgr:
        assert mgr.restore(state) == 3
    assert state["model"].out.weight is state["model"].emb.weight


class Lm(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_weights_saved_untied_and_restored_into_a_tied_model_are_warned_of(tmp_path):
    """One saved tensor overwrote the other in the shared memory, with nothing said. A
    warning, not a refusal: ranks that held unlike values of a tied weight save it from
    two ranks too, and such a job must still restore."""
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": Lm(tied=False)})
        said = r"ties model\.embed\.weight to model\.head\.weight \(one tensor\).*untied"
        with pytest.warns(RuntimeWarning, match=said):
            assert mgr.restore({"model": Lm(tied=True)}) == 1
        mgr.save(2, {"model": Lm(tied=True)})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # saved tied, restored tied
            assert mgr.restore({"model": Lm(tied=True)}) == 2
            assert mgr.restore({"model": Lm(tied=False)}, step=1) == 1  # as saved


class ManySmall(Net):
    """Net beside hundreds of small parameters (experts, adapters): a restore scanned every
    parameter name for each saved state key, and decoded the metadata three times."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(300)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + 1e-3 * sum(p.sum() for p in self.extra)


def test_a_model_of_many_small_parameters_resumes_reading_its_metadata_once(tmp_path, monkeypatch):
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = ManySmall()
        return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}

    check_resumes_bitwise(tmp_path, build)
    decodes = []
    decode = reader.metadata_from_json
    monkeypatch.setattr(
        reader, "metadata_from_json", lambda *a, **k: decodes.append(1) or decode(*a, **k)
    )
    with ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "staging") as mgr:
        assert mgr.restore(build(2)) == 3
    assert len(decodes) == 1


def test_bf16_model(tmp_path):
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net().to(torch.bfloat16)
        return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01)}

    check_resumes_bitwise(tmp_path, build)
    state = build(1)
    with ub.CheckpointManager(tmp_path / "durable", staging_dir=tmp_path / "staging") as mgr:
        mgr.restore(state)
    assert all(p.dtype == torch.bfloat16 for p in state["model"].parameters())
    assert state["optim"].state_dict()["state"][0]["exp_avg"].dtype == torch.bfloat16


def test_a_model_cast_to_another_dtype_since_the_save_is_warned_of_by_key(tmp_path):
    """fp32 weights restored into a model made bf16 were rounded with nothing said."""
    model = nn.Linear(3, 2)
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": model})
        cast = nn.Linear(3, 2).to(torch.bfloat16)
        said = r"cast to the state's: model\.bias \(float32 -> bfloat16\), model\.weight"
        with pytest.warns(RuntimeWarning, match=said) as seen:
            assert mgr.restore({"model": cast}) == 1
        ours = [w for w in seen if "cast to the state's" in str(w.message)]
        assert [w.filename for w in ours] == [__file__], seen  # where restore() was called
        assert torch.equal(cast.weight, model.weight.to(torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the saved dtype: nothing said
            assert mgr.restore({"model": nn.Linear(3, 2)}) == 1


def test_grad_scaler(tmp_path):
    """A GradScaler is one more entry; its scale and growth tracker come back."""

    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (8 + seed), growth_interval=2)
        return {
            "model": model,
            "optim": torch.optim.SGD(model.parameters(), lr=0.1),
            "scaler": scaler,
        }

    check_resumes_bitwise(tmp_path, build, save_at=3, after=4)


def test_a_grad_scaler_switched_off_since_the_save_is_named_with_the_way_out(tmp_path):
    """AMP turned off: the error blamed a list or dict that grew in training."""
    model = nn.Linear(2, 2)
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "scaler": torch.amp.GradScaler("cpu")})
        off = {"model": model, "scaler": torch.amp.GradScaler("cpu", enabled=False)}
        said = r"'scaler' is empty now and was not when saved .*strict=False"
        with pytest.raises(CheckpointMismatchError, match=said):
            mgr.restore(off)
        with pytest.warns(RuntimeWarning, match="strict=False without scaler.*switched off"):
            assert mgr.restore(off, strict=False) == 1


def test_generator_in_the_state(tmp_path):
    """Issue 22.5: a torch.Generator in the state is saved and restored: the same draws."""

    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        model = Net()
        return {
            "model": model,
            "optim": torch.optim.Adam(model.parameters(), lr=0.01),
            "gen": torch.Generator().manual_seed(100 + seed),
        }

    check_resumes_bitwise(tmp_path, build)


def test_a_generator_an_older_version_kept_in_dcp_is_restored_from_there(tmp_path):
    """Before generators moved into each rank's RNG record, one copy of their state was a
    DCP tensor under the entry's name; such a checkpoint still restores them."""
    saved = torch.Generator().manual_seed(7)
    torch.rand(5, generator=saved)
    old = ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", every_steps=None)
    old.save(3, {"model": Net(), "gen": saved.get_state()})  # what the older save wrote
    old.close()
    gen = torch.Generator().manual_seed(0)
    new = ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s2", every_steps=None)
    assert new.restore({"model": Net(), "gen": gen}) == 3
    new.close()
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=saved))


def test_a_generator_the_checkpoint_lacks_is_named(tmp_path):
    mgr = ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", every_steps=None)
    mgr.save(1, {"model": Net()})
    with pytest.raises(ub.CheckpointMismatchError, match=r"'gen' is a torch.Generator"):
        mgr.restore({"model": Net(), "gen": torch.Generator()})
    gen = torch.Generator().manual_seed(5)
    assert mgr.restore({"model": Net(), "gen": gen}, strict=False) == 1
    fresh = torch.Generator().manual_seed(5)
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=fresh))
    mgr.close()


class Progress:
    """A user's own object with state_dict/load_state_dict; its state has an empty mapping
    and a list, which must come back as they were."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.history: list[float] = []
        self.refuse = False

    def state_dict(self) -> dict:
        return {"seen": dict(self.seen), "history": list(self.history), "extra": {}}

    def load_state_dict(self, sd: dict) -> None:
        if self.refuse:
            raise ValueError("Progress: this checkpoint is from another dataset")
        assert sd["extra"] == {}
        self.seen, self.history = dict(sd["seen"]), list(sd["history"])


def test_any_state_dict_object(tmp_path):
    torch.manual_seed(0)
    model = Net()
    progress = Progress()
    progress.history = [0.5, 0.25]
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "progress": progress})
        again = Progress()
        assert mgr.restore({"model": Net(), "progress": again}) == 1
    assert again.seen == {} and again.history == [0.5, 0.25]


def test_non_persistent_buffers_are_left_alone(tmp_path):
    def build() -> nn.Module:
        model = nn.Linear(3, 2)
        model.register_buffer("scratch", torch.zeros(3), persistent=False)
        return model

    saved = build()
    saved.scratch.fill_(1.0)
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(1, {"model": saved})
        fresh = build()
        fresh.scratch.fill_(7.0)
        assert mgr.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, saved.weight)
    assert torch.equal(fresh.scratch, torch.full((3,), 7.0))


def _adam(model: Net) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _grouped(model: Net, first: list[str]) -> torch.optim.Optimizer:
    named = dict(model.named_parameters())
    rest = [p for n, p in named.items() if n not in first]
    return torch.optim.Adam(
        [{"params": [named[n] for n in first], "lr": 0.1}, {"params": rest, "lr": 0.2}]
    )


def _refusing(model: Net) -> dict:
    progress = Progress()
    progress.refuse = True
    return {"optim": _adam(model), "progress": progress}


# case: (the saved state's parts, the restored state's parts, the error, what it says)
REFUSED: dict[str, tuple[Callable[[Net], dict], Callable[[Net], dict], type, str]] = {
    "a-user-object-refuses": (
        lambda m: {"optim": _adam(m), "progress": Progress()},
        _refusing,
        ValueError,
        "another dataset",
    ),
    "another-optimizer": (
        lambda m: {"optim": _adam(m)},
        lambda m: {"optim": torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)},
        CheckpointMismatchError,
        r"'optim': its parameter groups hold .*momentum.*, the checkpoint's .*betas",
    ),
    # torch would load this one, leaving a group without its lr
    "other-parameter-groups": (
        lambda m: {"optim": _grouped(m, ["lin.weight", "lin.bias"])},
        lambda m: {"optim": _grouped(m, ["lin.weight"])},
        CheckpointMismatchError,
        r"group 0: \['lin.bias', 'lin.weight'\] in the checkpoint, \['lin.weight'\] in the state",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_restore_leaves_model_and_optimizer_as_they_were(tmp_path, case):
    """A part of the state that refuses the checkpoint fails the restore before the
    model's weights (or the optimizer) are overwritten: the job can still go on as it is."""
    saved_parts, fresh_parts, error, match = REFUSED[case]
    torch.manual_seed(0)
    model = Net()
    state = {"model": model, **saved_parts(model)}
    train(state, range(2))
    with ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s") as mgr:
        mgr.save(2, state)
        torch.manual_seed(1)
        fresh = Net()
        fresh_state = {"model": fresh, **fresh_parts(fresh)}
        before = snapshot(fresh_state)
        with pytest.raises(error, match=match):
            mgr.restore(fresh_state)
    assert_bitwise(snapshot(fresh_state), before, "refused")


def test_a_scheduler_added_since_the_save_is_named_not_called_another_model(tmp_path):
    """A scheduler writes settings (initial_lr) into the optimizer's groups: a run that
    adds one is told so, and strict=False keeps this run's settings."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"model": model, "optim": optim})
    fresh = torch.nn.Linear(4, 4)
    optim2 = torch.optim.Adam(fresh.parameters())
    torch.optim.lr_scheduler.CosineAnnealingLR(optim2, T_max=10)
    before = fresh.weight.detach().clone()
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st2") as mgr:
        with pytest.raises(ub.CheckpointMismatchError, match=r"initial_lr.*LR scheduler") as e:
            mgr.restore({"model": fresh, "optim": optim2})
        assert "another model" not in str(e.value)
        assert torch.equal(fresh.weight, before)  # nothing loaded
        assert mgr.restore({"model": fresh, "optim": optim2}, strict=False) == 1
    assert torch.equal(fresh.weight, model.weight)
    assert optim2.param_groups[0]["initial_lr"] == 0.001


def test_a_parameter_group_added_since_the_save_is_named_not_blamed_on_a_scheduler(tmp_path):
    """A no-weight-decay group added: the message blamed an LR scheduler and offered
    strict=False, which then failed on the groups."""
    model = torch.nn.Linear(4, 4)
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"model": model, "optim": torch.optim.AdamW(model.parameters())})
    fresh = torch.nn.Linear(4, 4)
    split = [{"params": [fresh.weight]}, {"params": [fresh.bias], "weight_decay": 0.0}]
    state = {"model": fresh, "optim": torch.optim.AdamW(split)}
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st2") as mgr:
        for strict in (True, False):
            with pytest.raises(ub.CheckpointMismatchError, match=r"has 2 parameter group\(s\), "
                               r"the checkpoint's 1") as e:  # fmt: skip
                mgr.restore(state, strict=strict)
            assert "scheduler" not in str(e.value)
    with ub.CheckpointManager(tmp_path / "model-only", staging_dir=tmp_path / "st3") as mgr:
        mgr.save(1, {"model": model})  # no optimizer at all: strict=False leaves it alone
        assert mgr.restore(state, strict=False) == 1


def test_another_kind_of_optimizer_is_named_and_left_alone_with_strict_false(tmp_path):
    """SGD saved, AdamW now: the message blamed a scheduler and offered strict=False,
    which raised KeyError('step') half-way and left SGD's momentum_buffer in the AdamW."""
    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    sgd.step()
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"model": model, "optim": sgd})
    fresh = torch.nn.Linear(4, 4)
    adamw = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    before = fresh.weight.detach().clone()
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st2") as mgr:
        with pytest.raises(ub.CheckpointMismatchError, match=r"not of the kind that saved it "
                           r"\('optim': its parameter groups hold .*betas.*, the checkpoint's "
                           r".*momentum") as e:  # fmt: skip
            mgr.restore({"model": fresh, "optim": adamw})
        assert "scheduler" not in str(e.value) and str(tmp_path / "ck") in str(e.value)
        assert torch.equal(fresh.weight, before) and not adamw.state  # nothing loaded
        with pytest.warns(RuntimeWarning, match="'optim': its parameter groups hold") as w:
            assert mgr.restore({"model": fresh, "optim": adamw}, strict=False) == 1
        assert w[0].filename == __file__  # the warning points at the user's restore call
    assert torch.equal(fresh.weight, model.weight)  # the model loaded
    assert not adamw.state and adamw.param_groups[0]["lr"] == 1e-3  # the AdamW as it was
    fresh(torch.ones(1, 4)).sum().backward()
    adamw.step()  # and it steps


def test_an_entry_added_since_the_save_is_refused_with_the_way_out(tmp_path):
    model = torch.nn.Linear(4, 4)
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"model": model})
    ema = torch.zeros(4, 4)
    state = {"model": torch.nn.Linear(4, 4), "ema": ema}
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st2") as mgr:
        with pytest.raises(ub.CheckpointMismatchError, match=r"missing from the checkpoint: ema. "
                           r"Entries added since the save .* strict=False") as e:  # fmt: skip
            mgr.restore(state)
        assert str(tmp_path / "ck" / "step-") in str(e.value)  # the URL, not a staging copy
        assert mgr.restore(state, strict=False) == 1
    assert torch.equal(state["model"].weight, model.weight) and not ema.any()


def test_a_scheduler_switched_on_resume_is_not_taken_for_another_optimizer(tmp_path):
    """OneCycleLR saved, SWALR now: their settings in the groups differ both ways, which
    was taken for another kind of optimizer, and strict=False left the momentum out."""
    from torch.optim.swa_utils import SWALR

    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cycle = lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=10)
    model(torch.ones(1, 4)).sum().backward()
    sgd.step()
    cycle.step()
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st") as mgr:
        mgr.save(1, {"model": model, "optim": sgd})
    fresh = torch.nn.Linear(4, 4)
    sgd2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    SWALR(sgd2, swa_lr=0.05)
    state = {"model": fresh, "optim": sgd2}
    with ub.CheckpointManager(tmp_path / "ck", staging_dir=tmp_path / "st2") as mgr:
        with pytest.raises(ub.CheckpointMismatchError, match="LR scheduler added or removed"):
            mgr.restore(state)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing left as it is
            assert mgr.restore(state, strict=False) == 1
    momentum = [sgd2.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, sgd.state[p]["momentum_buffer"])
               for a, p in zip(momentum, model.parameters()))  # fmt: skip
