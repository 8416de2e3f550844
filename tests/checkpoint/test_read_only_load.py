"""unbroken.load: a job that only reads a run's checkpoints (an evaluation, an export)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken as ub
from tests.checkpoint.distributed import ROOT, check, rank_env, torchrun
from tests.checkpoint.manager_util import make_state, rng_draws, snapshot, train

TRAINER = textwrap.dedent(
    """
    import sys
    import torch
    import unbroken as ub
    from tests.checkpoint.manager_util import make_state, snapshot, train

    state = make_state(0)
    mgr = ub.CheckpointManager(sys.argv[1], every_steps=1)
    for step in range(1, 4):
        train(state, [step])
        mgr.save(step, state)
        mgr.wait()
    torch.save(snapshot(state), sys.argv[2])
    print("ready", flush=True)
    sys.stdin.read()  # alive, holding its staging dir, until the test closes stdin
    mgr.close()
    """
)


def files_under(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``roots`` with its size and mtime: what a reader must not touch."""
    out = {}
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                st = os.stat(os.path.join(dirpath, name))
                out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_snapshot(model: torch.nn.Module) -> dict:
    return {f"model.{k}": v.clone() for k, v in model.state_dict().items()}


def test_an_evaluation_beside_the_live_training_loads_its_newest_step_and_writes_nothing(
    tmp_path,
):
    url, saved = tmp_path / "run", tmp_path / "saved.pt"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(url), str(saved)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=rank_env(),
        cwd=ROOT,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "ready"
        expected = {k: v for k, v in torch.load(saved).items() if k.startswith("model.")}
        before = files_under(tmp_path)
        model = make_state(7)["model"]  # other weights, the same architecture
        seed_all(123)
        draws = rng_draws()
        seed_all(123)
        assert ub.load(url, {"model": model}) == 3  # only the model of a fuller state
        assert rng_draws() == draws, "load changed the process's RNG streams"
        for k, v in model_snapshot(model).items():
            assert torch.equal(v, expected[k]), k
        assert files_under(tmp_path) == before  # no staging dir, goodput attempt, claim
        # A manager here is the training's: refused its staging dir, told about load.
        with pytest.raises(ub.StagingDirInUseError, match=r"unbroken\.load\(url, state\)"):
            ub.CheckpointManager(url)
    finally:
        trainer.stdin.close()
        trainer.wait(timeout=60)
    assert trainer.returncode == 0


def test_load_takes_a_step_and_names_what_is_not_there(tmp_path):
    url = tmp_path / "run"
    state = make_state(0)
    with ub.CheckpointManager(url, staging_dir=tmp_path / "s", memory_tier=False) as mgr:
        for step in (2, 4):
            train(state, [step])
            mgr.save(step, state)
            mgr.wait()
            if step == 2:
                at_two = snapshot(state)
    other = make_state(1)
    assert ub.load(url, other, step=2) == 2
    got = snapshot(other)
    for k, v in at_two.items():
        assert torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k], k
    with pytest.raises(ub.NoCheckpointError, match="step 3"):
        ub.load(url, other, step=3)
    with pytest.raises(ub.NoCheckpointError, match=str(tmp_path / "empty")):
        ub.load(tmp_path / "empty", other)
    with pytest.raises(ub.CheckpointMismatchError, match="student"):
        ub.load(url, {"model": state["model"], "student": torch.zeros(3)})


@pytest.mark.multiprocess
def test_two_ranks_loading_every_new_step_agree_and_keep_one_group(tmp_path):
    url = tmp_path / "run"
    state = make_state(0)
    with ub.CheckpointManager(url, staging_dir=tmp_path / "s", memory_tier=False) as mgr:
        train(state, [1])
        mgr.save(1, state)
    torch.save(model_snapshot(state["model"]), tmp_path / "saved.pt")
    out = check(torchrun(2, str(url), str(tmp_path / "saved.pt"), script=Path(__file__)))
    assert out.count("loads ok") == 2


def _rank_main(url: str, saved: str) -> None:
    """Each rank loads the same checkpoint five times, as an evaluation polling a run."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model, threads = make_state(5)["model"], []
    for _ in range(5):
        assert ub.load(url, {"model": model}) == 1
        threads.append(threading.active_count())
    expected = torch.load(saved)
    assert all(torch.equal(v, expected[k]) for k, v in model_snapshot(model).items())
    assert len(set(threads)) == 1, f"threads grew across loads: {threads}"
    print(f"rank {dist.get_rank()}: loads ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:3])
