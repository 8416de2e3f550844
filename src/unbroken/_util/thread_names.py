"""Give our background threads their Python name in the OS as well (Linux).

Python (before 3.14) leaves every thread named after the process, so ``top -H``,
``perf`` and ``/proc/<pid>/task/*/comm`` cannot tell the checkpoint worker from the
training thread. A user asking "what is using my cores" should see ``unbroken-ckpt``.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15
_MAX_NAME_BYTES = 15
"""The kernel keeps 16 bytes, the last one NUL."""


def name_native_thread(name: str | None = None) -> bool:
    """Set the calling thread's OS name (default: its ``threading`` name); best effort.

    Usable as a ``ThreadPoolExecutor`` initializer. Returns whether the name was set.
    """
    if not sys.platform.startswith("linux"):
        return False
    text = name if name is not None else threading.current_thread().name
    raw = text.encode("ascii", "replace")[:_MAX_NAME_BYTES]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
