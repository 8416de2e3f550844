"""`--help` of the examples and of the demo says every option's default: an option that
takes a value names its default (or that it is required)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {
    "train_classifier": ["examples/train_classifier.py"],
    "train_lm": ["examples/train_lm.py"],
    "unbroken demo": ["-m", "unbroken.cli.main", "demo"],
    "demo job": ["-m", "unbroken.demo.job"],
}


def option_entries(text: str) -> dict[str, str]:
    """``--option METAVAR`` -> its help text, for the options that take a value."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[1].splitlines():
        head = re.match(r"^  (-[-\w]+)(?:, -[-\w]+)?( \S+)?(.*)$", line)
        if head:
            current = head[1] if head[2] else None  # a flag takes no value: no default
            if current:
                entries[current] = head[3]
        elif current and line.startswith(" " * 6):
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_that_takes_a_value_says_its_default(name):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    out = subprocess.run(
        [sys.executable, *COMMANDS[name], "--help"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    entries = option_entries(out.stdout)
    assert len(entries) >= 5, out.stdout
    silent = [opt for opt, text in entries.items() if not re.search("default|required", text)]
    assert not silent, f"{name} --help names no default for {silent}:\n{out.stdout}"
