"""Data sets for the end-to-end tests, written once per session by the examples' own
``make_data`` (imported in process: starting Python here costs seconds)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.harness import EXAMPLES


def _example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the examples import their sibling common.py
    return __import__(name)


@pytest.fixture(scope="session")
def jpeg_volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    _example("train_classifier").make_data(str(root), files=512)
    return root


@pytest.fixture(scope="session")
def token_volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    _example("train_lm").make_data(str(root), files=512)
    return root
