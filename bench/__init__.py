"""unbroken's benchmarks, one room per capability; run each as ``python -m bench.<room>.<name>``
from the repository root (see bench/README.md)."""
