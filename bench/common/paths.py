"""Where the checkout is, and how a benchmark starts another module of bench/ in a child."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: bench/ is imported from there as a package."""


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (the environment) with this checkout's src and root first on PYTHONPATH,
    so a child (another interpreter, a torchrun worker) imports ``bench`` and ``unbroken``
    from here."""
    env = dict(os.environ if base is None else base, **extra)
    paths = [str(ROOT / "src"), str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def module_argv(module: str, *args: str, python: str | None = None) -> list[str]:
    """``python -m module args``: a bench module run as a program of its own."""
    return [python or sys.executable, "-m", module, *args]
