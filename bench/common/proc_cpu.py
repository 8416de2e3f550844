"""CPU seconds of one process, read from /proc: for benchmarks that must tell their
loader's CPU from that of a server or a delay line they started themselves."""

from __future__ import annotations

import os


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the live process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
