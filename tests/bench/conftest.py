"""bench/ is a folder of scripts, not a package: make its modules importable here."""

from __future__ import annotations

import os
import sys

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH_DIR))
