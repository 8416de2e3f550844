"""Launching a 2-rank torchrun job of this repository from a benchmark, one way for all."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from bench.common.paths import ROOT, child_env

__all__ = ["ROOT", "free_port", "torchrun_cmd", "torchrun_env"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This checkout's package and tests importable, gloo on loopback, one thread per rank,
    torchrun's restarts made safe (its shared rendezvous store off)."""
    return child_env(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        **extra,
    )


def torchrun_cmd(job: Path | str, *args: str, restarts: int = 1) -> list[str]:
    """``torchrun --nproc-per-node 2`` on a free c10d endpoint, ``restarts`` allowed, running
    ``job``: a script's path, or the name of a module (``bench.checkpoint.restore_job``)."""
    target = [str(job)] if isinstance(job, Path) else ["-m", job]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--max-restarts", str(restarts), "--monitor-interval", "0.1", *target, *args,
    ]  # fmt: skip
