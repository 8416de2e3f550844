"""torchrun's restart trap: a worker whose agent shares its store across restarts is told."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.checkpoint.elastic_env import restart_hazard

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


@pytest.mark.multiprocess
@pytest.mark.parametrize("share, expected", [("0", 1), ("1", 0)])
def test_a_real_torchrun_worker_warns_once_only_without_the_fix(tmp_path, share, expected):
    out = check(
        torchrun(
            1,
            str(tmp_path / "ckpt"),
            str(tmp_path / "stage"),
            script=WORKER,
            max_restarts=1,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share},
        )
    )
    assert f"RESTART-WARNINGS {expected}" in out, out
