"""What the CLI says when the user's input is wrong: a message, never a traceback."""

from __future__ import annotations


class CliError(Exception):
    """A failure to report in one line and exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
