"""The public surface: every name users import from ``unbroken`` resolves."""

from __future__ import annotations

import subprocess
import sys

import unbroken


def test_every_public_name_imports():
    for name in unbroken.__all__:
        assert getattr(unbroken, name) is not None, name


def test_import_unbroken_does_not_import_torch():
    code = "import sys, unbroken; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
