"""Background threads that run torch's C++ code come to rest before the interpreter ends.

During finalization CPython ends a daemon thread that asks for the GIL with
``pthread_exit``, a forced unwind. Through torch's C++ frames (any op or collective that
let go of the GIL) that unwind reaches ``std::terminate``: the process aborts (SIGABRT,
"terminate called without an active exception", a core file) in place of exiting with
its own code, and torchrun reports a crash where a rank raised an exception. Owners of
such threads register here; at exit each is asked to end the work under way and start
nothing new, all within ``EXIT_GRACE_SECONDS``. The work rarely completes (no thread pool
takes new work once the interpreter's end began): the point is an exit with the
process's own code.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

EXIT_GRACE_SECONDS = 5.0
"""How long the interpreter's end waits, in all, for those threads to come to rest."""


class RestsAtExit(Protocol):
    def rest_before_exit(self, deadline: float) -> None:
        """Let the thread finish its current work, start nothing new, and end by
        ``deadline`` (``time.monotonic()``) if it can."""


_owners: list[weakref.ref[RestsAtExit]] = []


def rest_at_exit(owner: RestsAtExit) -> None:
    """Ask ``owner`` to let its threads rest when the interpreter ends (held weakly)."""
    _owners[:] = [ref for ref in _owners if ref() is not None]
    _owners.append(weakref.ref(owner))


@atexit.register
def _let_threads_rest() -> None:
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    for ref in list(_owners):  # each runs on meanwhile: the order does not matter
        owner = ref()
        if owner is None:
            continue
        try:
            owner.rest_before_exit(deadline)
        except Exception as exc:  # the process is ending: never let this stop it
            log.debug("background thread of %r did not come to rest: %s", owner, exc)
