"""The peers' own virtualenv: their pins would fight ours, so they live apart.

``python -m bench.peers.loaders --setup [--venv PATH]`` makes it: this interpreter's torch
(a CPU build here) held by a constraints file so pip can never swap in a CUDA torch,
pillow and boto3 at the versions this venv has (every row decodes and fetches with the
same libraries), the peers at the versions measured, and unbroken itself, editable.

torchvision is removed after the install: ``mosaicml-streaming`` depends on it, but no
torchvision wheel on PyPI imports beside a CPU torch 2.13 (torchvision 0.28.0, the one
that resolves, links libtorch_cuda.so: ``operator torchvision::nms does not exist``),
and the part of Streaming the benchmark uses (``streaming.base``) never imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

from bench.common.paths import ROOT, child_env

DEFAULT_VENV = os.environ.get("UNBROKEN_PEERS_VENV") or str(ROOT.parent / ".venv-peers")
"""Beside the checkout (``/work/.venv-peers`` for ``/work/main``), shared by worktrees."""

PEERS = ("mosaicml-streaming==0.13.0", "litdata==0.2.76", "torchdata==0.11.0", "s3fs")
"""The versions measured; a newer one is a new row, not a silent change. s3fs: LitData's
raw-files dataset lists an ``s3://`` prefix through fsspec (its README: ``pip install s3fs``)."""

MATCHED = ("torch", "pillow", "boto3", "botocore")
"""Held at this interpreter's versions, so the rows differ only in the loader."""


def venv_python(venv: str) -> str | None:
    """The venv's interpreter, if the venv has been made."""
    path = os.path.join(venv, "bin", "python")
    return path if os.access(path, os.X_OK) else None


def constraints(versions: dict[str, str]) -> str:
    """A pip constraints file pinning each package to the given version (pure)."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(versions.items()))


def _ours() -> dict[str, str]:
    found = {}
    for name in MATCHED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "torch":
                raise SystemExit(
                    "--setup needs torch in this interpreter: its version is the pin"
                ) from None
    return found


def setup_venv(venv: str, root: str, torch_index: str | None = None) -> None:
    """Make (or update) the peers' venv; prints what it pinned."""
    versions = _ours()
    if venv_python(venv) is None:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv_python(venv)
    assert python is not None
    path = os.path.join(venv, "constraints.txt")
    with open(path, "w") as f:
        f.write(constraints(versions))
    print(f"pins ({path}): " + ", ".join(f"{k}=={v}" for k, v in sorted(versions.items())))
    extra = ["--extra-index-url", torch_index] if torch_index else []
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", path, *extra, f"torch=={versions['torch']}",
         *PEERS, "boto3", "pillow", "numpy", "-e", root],
        check=True,
    )  # fmt: skip
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=True)
    check = (
        "import torch, litdata, torchdata, unbroken; "
        "from bench.peers.loader_rows import import_streaming_base; import_streaming_base(); "
        "print('peers venv ok: torch', torch.__version__, 'litdata', litdata.__version__)"
    )
    subprocess.run([python, "-c", check], check=True, env=child_env(), cwd=ROOT)
