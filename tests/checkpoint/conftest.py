"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import subprocess

import pytest

from unbroken.checkpoint.memory_tier import MEMORY_DIR_ENV


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """A 64 MiB tmpfs (Docker's default /dev/shm) as the memory tier's root."""
    where = tmp_path / "shm64"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    monkeypatch.setenv(MEMORY_DIR_ENV, str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
