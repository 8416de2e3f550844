"""bench.regenerate_docs puts each command's fresh table in its block, and nothing else."""

from __future__ import annotations

import subprocess
import sys

import bench.regenerate_docs as regenerate_docs
from bench.common.paths import ROOT, child_env, module_argv


def _regenerate(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        module_argv("bench.regenerate_docs", *args, python=sys.executable),
        cwd=ROOT, env=child_env(), **kw,
    )  # fmt: skip


def _doc(tmp_path, table_script: str, failing_script: str) -> str:
    return (
        "# Results\n\n"
        f"<!-- bench: python {table_script} --rows 2 -->\n"
        "```text\nold table\n```\n<!-- /bench -->\n\n"
        f"<!-- bench: python {failing_script} -->\n```text\nkept\n```\n<!-- /bench -->\n"
    )


def _scripts(tmp_path):
    table = tmp_path / "table.py"
    table.write_text(
        "import sys, json\n"
        "n = int(sys.argv[sys.argv.index('--rows') + 1])\n"
        "for i in range(n): print(f'row {i}  {i * 10}')\n"
        "print(json.dumps({'rows': n}))\n"
    )
    failing = tmp_path / "failing.py"
    failing.write_text("raise SystemExit(3)\n")
    return str(table), str(failing)


def test_only_the_named_block_is_rerun_and_json_is_left_out(tmp_path):
    table, failing = _scripts(tmp_path)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(_doc(tmp_path, table, failing))
    _regenerate(str(doc), "--only", "table.py", check=True)
    text = doc.read_text()
    assert "row 0  0\nrow 1  10\n```" in text
    assert "old table" not in text and '{"rows"' not in text
    assert "```text\nkept\n```" in text  # the other block is untouched, stamp and all
    fresh = text.split("```text\n")[1].splitlines()[0]  # the rerun block's own stamp
    assert fresh.startswith("measured ") and " UTC on " in fresh and "cores" in fresh


def test_a_failing_benchmark_keeps_its_block_and_the_others_still_land(tmp_path):
    table, failing = _scripts(tmp_path)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(_doc(tmp_path, table, failing))
    done = _regenerate(str(doc), capture_output=True, text=True)
    assert done.returncode != 0 and "failing.py" in done.stderr
    text = doc.read_text()
    assert "```text\nkept\n```" in text  # the failed one's old output stays
    assert "row 1  10" in text  # the one that ran before it is not lost


def test_blocks_lists_commands_in_order(tmp_path):
    table, failing = _scripts(tmp_path)
    assert regenerate_docs.blocks(_doc(tmp_path, table, failing)) == [
        f"python {table} --rows 2",
        f"python {failing}",
    ]
