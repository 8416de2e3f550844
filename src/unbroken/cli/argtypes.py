"""Argument types that refuse a bad number as it is parsed (argparse's exit 2, its name)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def finite(text: str) -> float:
    """A float argument that is a number: inf and nan are refused as they are parsed."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number is needed, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A finite float >= 0."""
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds >= 0 are needed, got {text!r}")
    return value


def int_at_least(least: int, why: str = "") -> Callable[[str], int]:
    """An int argument >= ``least`` (``why``: said when it is not)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number is needed, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"at least {least} is needed{why}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse
