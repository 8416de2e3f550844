"""Lower the CPU and I/O priority of the calling thread (Linux), best effort.

Background checkpoint work should steal as little as it can from training. On Linux
``nice`` and ``ioprio`` are per thread, and threads the lowered thread starts inherit
both, so calling this first thing in a worker thread covers its helpers too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

log = logging.getLogger(__name__)

_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_BE = 2
_IOPRIO_WHO_PROCESS = 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def lower_thread_priority(nice: int = 10, io_level: int = 7) -> dict[str, bool]:
    """Renice this thread by ``nice`` and put its I/O in best-effort level ``io_level``.

    Returns which of the two took effect; failures are logged, never raised.
    """
    done = {"nice": False, "ioprio": False}
    if not sys.platform.startswith("linux"):
        return done
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
        done["nice"] = True
    except OSError as e:
        log.debug("could not renice checkpoint thread %d: %s", tid, e)
    number = _SYS_IOPRIO_SET.get(platform.machine())
    if number is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | io_level
            if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) == 0:
                done["ioprio"] = True
            else:
                log.debug("ioprio_set failed: errno %d", ctypes.get_errno())
        except OSError as e:
            log.debug("ioprio_set unavailable: %s", e)
    return done
