"""A warning the library gives reaches the terminal as one line of the command's own."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.cli.test_cli import ROOT, run


def test_an_odd_step_directory_is_one_warning_line(tmp_path, capsys):
    odd = tmp_path / "step-0000000000099"  # 13 digits: not how unbroken names step 99
    odd.mkdir()
    (odd / "manifest.json").write_text("{}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    p = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "ls", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = p.stderr.splitlines()
    assert f"unbroken ls: warning: {odd} is not a checkpoint directory" in lines[0]
    assert "RuntimeWarning" not in p.stderr and ".py:" not in p.stderr
    assert lines[1:] == [f"unbroken ls: error: no checkpoints under {tmp_path}"]
    code, _out, err = run(capsys, "ls", str(tmp_path))  # in process: the same line
    assert code == 1 and err.startswith("unbroken: warning: ") and ".py:" not in err
