"""Emulated links for tests: a fresh name per use, all removed when the session ends.

A link's timeline file outlives the processes that used it (by design: the next job on
the node shares it), so names made up for one test would pile up in /dev/shm.
"""

from __future__ import annotations

import glob
import os
import uuid

from unbroken.storage.link import discard_link, link_state_path

SESSION_TAG = f"test-{os.getpid()}"
"""Every link name of this test session starts with this."""


def private_link(tag: str = "link") -> str:
    """A link name no other test (or test session) uses."""
    return f"{SESSION_TAG}-{tag}-{uuid.uuid4().hex[:8]}"


def discard_links(prefix: str = SESSION_TAG) -> int:
    """Remove the timelines of the links whose names start with ``prefix``."""
    head = link_state_path(prefix)[: -len(".state")]
    removed = 0
    for path in glob.glob(glob.escape(head) + "*.state"):
        name = os.path.basename(path)[len("unbroken-link-") : -len(".state")]
        removed += discard_link(name)
    return removed
