"""torchrun's restart trap: a worker whose agent shares its store across restarts is told."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from unbroken.checkpoint.elastic_env import FIX, restart_hazard

from .distributed import check, torchrun

WORKER = Path(__file__).with_name("_elastic_worker.py")
ELASTIC = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "3"}


def test_the_trap_is_named_with_the_fix():
    why = restart_hazard({**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert why is not None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in why and "--max-restarts 3" in why


@pytest.mark.parametrize(
    "environ",
    [
        {},  # not under torchrun
        {**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "False"},  # the fix is set
        {**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"},
    ],
)
def test_no_warning_where_restarts_cannot_hang(environ):
    assert restart_hazard(environ) is None


def _absent_or(key: str, value: str | None) -> dict[str, str]:
    return {} if value is None else {key: value}


AXES = {
    "TORCHELASTIC_RUN_ID": [None, "none", "job-7"],
    "TORCHELASTIC_USE_AGENT_STORE": [None, "True", "False"],
    "TORCHELASTIC_MAX_RESTARTS": [None, "0", "3", "many"],
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": [None, "0", "1"],
}


@pytest.mark.parametrize("values", list(itertools.product(*AXES.values())))
def test_every_launch_environment_gets_the_verdict_its_rendezvous_earns(values):
    """Restarts hang only where the workers share the agent's store across restart rounds
    (torchrun set USE_AGENT_STORE=True) and there are restarts; the variable set and the
    store still shared means the static rendezvous, which ignores it."""
    environ = {k: v for k, v in zip(AXES, values) if v is not None}
    run_id, agent_store, restarts, fix = values
    why = restart_hazard(environ)
    if run_id is None or agent_store != "True" or restarts not in ("3",):
        assert why is None
    elif fix == "1":
        assert why is not None and "static rendezvous" in why and "ignores" in why
        assert "--rdzv-backend c10d" in why and "--max-restarts 0" in why
        assert "without" not in why.split(",")[0]  # it does not claim the variable is unset
    else:
        assert why is not None and f"without {FIX}" in why and "--rdzv-backend c10d" in why


def _worker_output(tmp_path, share: str, rdzv_backend: str | None = "c10d") -> str:
    """What a real torchrun worker (1 rank, --max-restarts 1) printed about its warnings."""
    return check(
        torchrun(
            1,
            str(tmp_path / "ckpt"),
            str(tmp_path / "stage"),
            script=WORKER,
            max_restarts=1,
            rdzv_backend=rdzv_backend,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share},
        )
    )


@pytest.mark.multiprocess
def test_a_real_static_rendezvous_is_named_though_the_variable_is_set(tmp_path):
    """`--rdzv-endpoint` without `--rdzv-backend`: torchrun's static rendezvous."""
    out = _worker_output(tmp_path, "1", rdzv_backend=None)
    assert "RESTART-WARNINGS 1" in out, out
    assert "static rendezvous" in out and "--rdzv-backend c10d" in out, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("share, expected", [("0", 1), ("1", 0)])
def test_a_real_torchrun_worker_warns_once_only_without_the_fix(tmp_path, share, expected):
    out = _worker_output(tmp_path, share)
    assert f"RESTART-WARNINGS {expected}" in out, out
