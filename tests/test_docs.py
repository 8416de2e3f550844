"""Every ```python block of the docs runs, so no sample a user copies is stale.

The blocks of one file run in order in one namespace (a page builds on its earlier
blocks), in a fresh temporary working directory, with the default cache and staging
directories pointed there too. A block that needs what a test machine lacks (an S3
server, a cluster) is marked with ``<!-- not-run: why -->`` on the line before it: it is
still compiled, and reported as skipped with that reason.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.checkpoint.distributed import check, torchrun
from unbroken import open_store
from unbroken.goodput import events as ev

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<why>.+?)\s*-->$")
MAX_NOT_RUN = 6
"""Blocks that cannot run here must stay the exception."""


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md"]
    return files + sorted((ROOT / "docs").rglob("*.md"))


@dataclass
class Block:
    path: Path
    line: int
    """1-based line of the block's first line of code."""
    source: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path}:{i + 1}: a ```python block that never ends"
        source = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(path, i + 2, source, marker["why"] if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for path in doc_files() for b in python_blocks(path)]
RUN_FILES = sorted({b.path for b in ALL_BLOCKS if b.not_run is None})
NOT_RUN_BLOCKS = [b for b in ALL_BLOCKS if b.not_run is not None]


def _compiled(block: Block):
    # Blank lines first, so a traceback names the line of the Markdown file.
    return compile("\n" * (block.line - 1) + block.source, str(block.path), "exec")


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_blocks_of_a_page_run_in_order(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UNBROKEN_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.setenv("UNBROKEN_STAGING_DIR", str(tmp_path / "default-staging"))
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(path):
        if block.not_run is None:
            exec(_compiled(block), namespace)


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=lambda b: b.where)
def test_a_block_marked_not_run_still_compiles_and_says_why(block):
    _compiled(block)
    pytest.skip(f"{block.where} not run: {block.not_run}")


def test_the_docs_have_samples_and_few_are_left_unrun():
    assert len(RUN_FILES) >= 5, RUN_FILES
    assert len(NOT_RUN_BLOCKS) <= MAX_NOT_RUN, [b.where for b in NOT_RUN_BLOCKS]


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_sample_imports_the_modules_it_uses():
    """A block copied alone must not fail on a module only an earlier block imported."""
    missing = []
    for path in doc_files():
        before: set[str] = set()
        for block in python_blocks(path):
            tree = ast.parse(block.source)
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            if lacking := sorted((used & before) - _imported(tree)):
                missing.append(f"{block.where}: import {', '.join(lacking)}")
            before |= _imported(tree)
    assert not missing, missing


def test_every_not_run_marker_sits_right_before_a_python_block():
    """A marker that drifted away from its block would skip nothing, or the wrong one."""
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                after = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
                assert after == "```python", f"{path}:{i + 1}: marker not before a python block"


def test_relative_links_between_the_docs_lead_somewhere():
    link = re.compile(r"\]\((?!https?://|#)([^)#\s]+)")
    for path in doc_files():
        for target in link.findall(path.read_text()):
            assert os.path.exists(path.parent / target), f"{path}: broken link {target}"


INTERNAL_ERRORS = {
    "TransientStoreError": "retried inside the store; users see RetriesExhaustedError",
    "StagingBusyError": "the manager checks stager.busy first; it skips or waits instead",
    "UnsafeValueError": "reaches users as the cause of a SaveFailedError or as corruption",
    "CliError": "the CLI prints it as one line, 'unbroken VERB: error: ...', and exits 1 or 2",
    "PeerError": "a replica's failure is logged (the guide lists the line); a restore gives "
    "the peer up and reads the durable tier",
}
"""Error classes no user meets as such, and why."""


def test_every_error_a_user_can_meet_is_in_the_troubleshooting_guide():
    """A new error class needs its entry: what it means and what to do."""
    defined = set()
    for path in (ROOT / "src" / "unbroken").rglob("*.py"):
        defined |= set(re.findall(r"^\s*class (\w+Error)\(", path.read_text(), re.M))
    guide = (ROOT / "docs" / "troubleshooting.md").read_text()
    guide += (ROOT / "docs" / "storage.md").read_text()
    missing = sorted(e for e in defined - set(INTERNAL_ERRORS) if e not in guide)
    assert not missing, f"add these to docs/troubleshooting.md: {missing}"


def test_the_readme_sample_run_twice_restores_where_the_first_ended(tmp_path, monkeypatch):
    """What the README says right after its sample: run it again and it restores step 20."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UNBROKEN_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.setenv("UNBROKEN_STAGING_DIR", str(tmp_path / "default-staging"))
    blocks = [b for b in python_blocks(ROOT / "README.md") if b.not_run is None]
    restored = []
    for _ in range(2):
        namespace: dict = {"__name__": "__docs__"}
        for block in blocks:
            exec(_compiled(block), namespace)
        last = namespace["mgr"].last_restore
        restored.append(None if last is None else last.step)
    assert restored == [None, 20]


def restored_steps(checkpoints: Path) -> list[list[int | None]]:
    """What each run restored, rank by rank, in the order the runs started (read from the
    goodput event log every manager writes beside its checkpoints)."""
    runs = []
    for ranks in ev.read_log(open_store(str(checkpoints))).values():
        start = min(e.t for events in ranks.values() for e in events if e.kind == ev.START)
        steps = [
            next(e.step for e in ranks[r] if e.kind == ev.RESTORE_END) for r in sorted(ranks)
        ]
        runs.append((start, steps))
    return [steps for _, steps in sorted(runs)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "page, last",
    # launch.md's script is the README's with a lock: behind -m slow, for CI's time
    [("README.md", 20), pytest.param("docs/launch.md", 12, marks=pytest.mark.slow)],
)
def test_a_sample_launched_under_torchrun_restores_its_last_step_when_run_again(
    page, last, tmp_path
):
    """What the pages say: launch the sample under torchrun; run it again and it resumes."""
    script = tmp_path / "train.py"
    blocks = [b for b in python_blocks(ROOT / page) if b.not_run is None]
    script.write_text("".join(b.source for b in blocks))
    env = {
        "UNBROKEN_CACHE_DIR": str(tmp_path / "default-cache"),
        "UNBROKEN_STAGING_DIR": str(tmp_path / "default-staging"),
    }
    for _ in range(2):
        check(torchrun(2, script=script, cwd=tmp_path, env=env))
    assert restored_steps(tmp_path / "checkpoints") == [[None, None], [last, last]]
