"""Where default staging directories live: one folder per user, one directory per URL."""

from __future__ import annotations

import os
import tempfile


def default_staging_base() -> str:
    """``$UNBROKEN_STAGING_DIR``, else ``unbroken-staging-<uid>`` in the temp directory."""
    return os.environ.get("UNBROKEN_STAGING_DIR") or os.path.join(
        tempfile.gettempdir(), f"unbroken-staging-{os.getuid() if hasattr(os, 'getuid') else 0}"
    )


def is_default_staging_dir(path: str) -> bool:
    """A directory unbroken chose (and may remove once empty), not one the user named."""
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(default_staging_base())
