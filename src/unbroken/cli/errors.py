"""What the CLI says when the user's input is wrong: a message, never a traceback."""

from __future__ import annotations

STORE_UNREADABLE = 3
"""The exit status when the store could not be read at all (unreachable, timed out,
credentials refused): a monitoring script tells it from a damaged checkpoint (1)."""


class CliError(Exception):
    """A failure to report in one line and exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
