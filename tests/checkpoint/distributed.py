"""Launch real ranks with real torchrun (gloo, CPU) for the multi-rank checkpoint tests.

Every launch carries ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (DESIGN.md, "Known traps":
without it a restarted gloo rank can read its peer's stale address and hang) and a hard
timeout, and puts this worktree's ``src`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from unbroken._util.procs import signal_tree

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("dist_scenarios.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_stacks(pid: int, settle: float = 2.0) -> None:
    """Ask a launcher and every process under it for its threads' stacks (SIGUSR1, which
    ``tests/stack_dumps/sitecustomize.py`` hands to faulthandler), before a test that gave
    up on a hung job kills it: the job's output then says where each process waited."""
    import time

    signal_tree(pid, signal.SIGUSR1)
    time.sleep(settle)  # the dumps travel through the pipes before the kill


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it, and wait until they are gone."""
    import psutil

    killed = set(signal_tree(pid, signal.SIGKILL))
    psutil.wait_procs([p for p in psutil.process_iter() if p.pid in killed], timeout=30)


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # what the caller's path had stays after ours (packages installed with --target)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    stacks = str(Path(__file__).parents[1] / "stack_dumps")  # SIGUSR1: faulthandler
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), stacks, *inherited])
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("TORCHELASTIC_RUN_ID", None)
    env.update(extra or {})
    return env


def torchrun(
    nproc: int,
    *args: str,
    timeout: float = 120,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    script: Path = SCENARIOS,
    cwd: Path = ROOT,
    rdzv_backend: str | None = "c10d",
) -> subprocess.CompletedProcess:
    """Run ``script *args`` (default dist_scenarios.py) on ``nproc`` ranks; kill the whole
    tree on timeout. ``rdzv_backend=None``: torchrun's default, the static rendezvous."""
    backend = ["--rdzv-backend", rdzv_backend] if rdzv_backend else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        *backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        str(script),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=rank_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(
            f"torchrun {' '.join(args)} timed out after {timeout}s:\n{out}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def check(result: subprocess.CompletedProcess) -> str:
    """The output of a run that must have succeeded."""
    assert result.returncode == 0, f"ranks failed (rc={result.returncode}):\n{result.stdout}"
    return result.stdout


def toy_volume(root: Path, files: int = 64, size: int = 16) -> Path:
    """A directory of ``files`` raw files, file i holding ``size`` bytes of value i."""
    volume = root / "volume"
    volume.mkdir()
    for i in range(files):
        (volume / f"{i:03d}.bin").write_bytes(bytes([i]) * size)
    return volume
