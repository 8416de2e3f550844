"""Every verb of the ``unbroken`` command on a real checkpoint directory and on bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken as ub
from unbroken.checkpoint.format.manifest import step_dir
from unbroken.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Steps 2 and 4 committed, step 6 partial (a shard, no manifest)."""
    root = tmp_path_factory.mktemp("cli")
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": optim, "epoch": 3}
    with ub.CheckpointManager(
        root / "ck", staging_dir=root / "st", every_steps=2, when_busy="wait"
    ) as mgr:
        for step in range(1, 5):
            model(torch.ones(2, 64)).sum().backward()
            optim.step()
            mgr.maybe_save(step, state)
    partial = root / "ck" / step_dir(6)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    return root / "ck"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: usage errors and --help
        code = exc.code
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out, out.err


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_ls_shows_committed_and_partial_with_the_reason(capsys, checkpoints):
    code, out, _ = run(capsys, "ls", str(checkpoints))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["step", "state", "size", "age", "ranks"]
    assert lines[1].split()[:2] == ["2", "committed"]
    assert lines[2].split()[:2] == ["4", "committed"]
    assert lines[3].split()[:2] == ["6", "partial"] and "no manifest" in lines[3]


def test_ls_json_has_the_catalog_field_names(capsys, checkpoints):
    code, out, _ = run(capsys, "ls", str(checkpoints), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [d["step"] for d in doc] == [2, 4, 6]
    assert set(doc[0]) >= {"step", "committed", "nbytes", "created", "world_size", "problem"}
    assert doc[0]["committed"] and doc[0]["world_size"] == 1 and doc[0]["problem"] is None
    assert not doc[2]["committed"] and "no manifest" in doc[2]["problem"]


def test_ls_calls_a_commit_record_over_a_missing_shard_damaged_not_partial(
    capsys, checkpoints, tmp_path
):
    """The word "partial" reads as a save cut short; verify calls the same step CORRUPT."""
    root = tmp_path / "ck"
    shutil.copytree(checkpoints, root)
    (root / step_dir(2) / "__0_0.distcp").unlink()
    code, out, _ = run(capsys, "ls", str(root))
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
    assert code == 0 and rows == {"2": "damaged", "4": "committed", "6": "partial"}, out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert [d["damaged"] for d in json.loads(out)] == [True, False, False]


def test_ls_of_a_hand_edited_manifest_with_no_date_shows_none(capsys, checkpoints, tmp_path):
    """A manifest of the format before its own checksum, ``created`` edited to -inf: ls
    crashed (round(inf)) and ``--json`` printed NaN, which strict JSON refuses."""
    root = tmp_path / "ck"
    shutil.copytree(checkpoints, root)
    path = root / step_dir(2) / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["manifest_crc32c"]
    doc["created"] = float("-inf")
    path.write_text(json.dumps(doc))
    code, out, _ = run(capsys, "ls", str(root))
    row = out.splitlines()[1].split()
    assert code == 0 and row[:2] == ["2", "committed"] and row[4] == "-", row  # no age
    code, out, _ = run(capsys, "ls", str(root), "--json")

    def not_json(word: str):
        raise ValueError(f"{word} is not strict JSON")

    assert code == 0 and json.loads(out, parse_constant=not_json)[0]["created"] is None


def test_verify_passes_a_sound_directory(capsys, checkpoints):
    code, out, _ = run(capsys, "verify", str(checkpoints))
    assert code == 0
    assert out.count("ok ") == 2


def test_verify_names_the_file_with_a_flipped_byte(capsys, checkpoints, tmp_path):
    ck = copy_tree(checkpoints, tmp_path / "ck")
    shard = ck / step_dir(4) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", str(ck))
    assert code == 1
    assert f"CORRUPT {ck / step_dir(4) / '__0_0.distcp'}" in out
    assert "crc32c" in out and "1 problem(s) in 1 checkpoint(s)" in err
    code, out, _ = run(capsys, "verify", str(ck), "--step", "2")
    assert code == 0
    code, out, _ = run(capsys, "verify", str(ck), "--step", "4", "--json")
    assert code == 1 and "__0_0.distcp" in json.loads(out)["4"][0]


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root needs setpriv to be refused"
)
@pytest.mark.parametrize("refused", ["__0_0.distcp", "manifest.json"])
@pytest.mark.parametrize("flipped", [False, True], ids=["sound", "step-2-flipped"])
def test_verify_tells_a_step_it_could_not_read_from_a_damaged_one(
    checkpoints, tmp_path, flipped, refused
):
    """A shard the store refused (permission denied) made verify exit 3, "nothing was
    checked", though it had found step 2 damaged: a monitor took damage for an outage."""
    ck = copy_tree(checkpoints, tmp_path / "ck")
    if flipped:
        shard = ck / step_dir(2) / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    (ck / step_dir(4) / refused).chmod(0)  # (a manifest: read as the steps are listed)
    drop = "-dac_override,-dac_read_search"  # root reads a file chmod 000 without them
    as_user = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"]
    run = subprocess.run(
        [*(as_user if os.geteuid() == 0 else []), sys.executable, "-m", "unbroken.cli",
         "verify", str(ck), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert f"UNREAD  {ck / step_dir(4)}: not checked: StorePermissionError" in run.stdout
    assert run.returncode == (1 if flipped else 3), run.stdout + run.stderr
    assert (f"CORRUPT {ck / step_dir(2)}" in run.stdout) == flipped, run.stdout


@pytest.mark.parametrize("damage", ["edited", "cut short"])
def test_verify_names_a_damaged_manifest(capsys, checkpoints, tmp_path, damage):
    """Restore would skip that step without a word: verify must say so and exit 1."""
    ck = copy_tree(checkpoints, tmp_path / "ck")
    manifest = ck / step_dir(4) / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"epoch": 3', '"epoch": 4') if damage == "edited"
                        else text[: len(text) // 2])  # fmt: skip
    assert damage == "cut short" or '"epoch": 4' in manifest.read_text()
    code, out, _err = run(capsys, "verify", str(ck))
    assert code == 1, out
    assert f"CORRUPT {ck / step_dir(4)}/manifest.json" in out
    assert "ok " in out  # step 2 is sound


def test_verify_of_a_live_job_is_not_fooled_by_its_retention(
    capsys, checkpoints, tmp_path, monkeypatch
):
    """A hostile user's find: a cron `verify` of a running job exited 1 ("corruption")
    whenever retention removed a step between the listing and its check."""
    import unbroken.cli.verify as verify

    ck = copy_tree(checkpoints, tmp_path / "ck")
    listed = verify.list_checkpoints

    def verify_while_retention_removes(*steps: int) -> tuple[int, str, str]:
        def list_then_prune(store, **kwargs):  # the job's retention runs after our listing
            infos = listed(store, **kwargs)
            for step in steps:
                store.delete(step_dir(step))
            return infos

        monkeypatch.setattr(verify, "list_checkpoints", list_then_prune)
        return run(capsys, "verify", str(ck))

    code, out, _ = verify_while_retention_removes(2)
    assert code == 0, out
    assert f"gone    {ck / step_dir(2)}: removed while verifying" in out
    assert f"ok      {ck / step_dir(4)}" in out
    code, out, err = verify_while_retention_removes(4)  # every step gone: nothing checked
    assert code == 1 and "nothing was checked" in err, (out, err)


def test_verify_calls_a_commit_record_deleted_by_hand_meanwhile_damage(
    capsys, checkpoints, tmp_path, monkeypatch
):
    """Retention leaves nothing of a step; a record deleted with the files left is not
    'gone' (a later reviewer's find)."""
    import unbroken.cli.verify as verify

    ck = copy_tree(checkpoints, tmp_path / "ck")
    listed = verify.list_checkpoints

    def list_then_break(store, **kwargs):
        infos = listed(store, **kwargs)
        store.delete(f"{step_dir(2)}/manifest.json")
        return infos

    monkeypatch.setattr(verify, "list_checkpoints", list_then_break)
    monkeypatch.setattr(verify, "GONE_WAIT_SECONDS", 0.5)
    code, out, _ = run(capsys, "verify", str(ck))
    assert code == 1 and f"CORRUPT {ck / step_dir(2)}" in out and "gone" not in out, out


@pytest.mark.parametrize("url", ["", "s4://bucket/ck", "s3:/bucket/ck"])
def test_a_malformed_url_is_a_bad_argument(capsys, url):
    """Exit 2, as the docs say of bad arguments (an empty URL exited 1, as corruption)."""
    code, _, err = run(capsys, "ls", url)
    assert code == 2 and "cannot open" in err, err


def test_verify_of_a_partial_or_absent_step_fails(capsys, checkpoints):
    code, out, _ = run(capsys, "verify", str(checkpoints), "--step", "6")
    assert code == 1 and "not committed" in out
    where = checkpoints / step_dir(6)
    assert out.startswith(f"PARTIAL {where}: ") and f"{where}/" not in out, out  # not damage
    code, _, err = run(capsys, "verify", str(checkpoints), "--step", "7")
    assert code == 1 and "no checkpoint of step 7" in err


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _extend(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"tail")


def _into_a_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


SHARD_DAMAGE = {
    "truncated": (_truncate, "bytes, manifest says"),
    "extended": (_extend, "bytes, manifest says"),
    "missing": (Path.unlink, "missing"),
    "a directory": (_into_a_directory, "a directory"),
}


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_verify_names_the_shard_not_the_manifest(capsys, checkpoints, tmp_path, damage):
    """A shard cut short, grown, gone or replaced by a directory: the shard is at fault,
    and its manifest is sound (text and --json alike)."""
    ck = copy_tree(checkpoints, tmp_path / "ck")
    do, why = SHARD_DAMAGE[damage]
    do(ck / step_dir(4) / "__0_0.distcp")
    code, out, _ = run(capsys, "verify", str(ck))
    assert code == 1, out
    bad = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert bad == [line for line in bad if line.startswith(f"CORRUPT {ck / step_dir(4)}/")]
    assert len(bad) == 1 and bad[0].startswith(f"CORRUPT {ck / step_dir(4) / '__0_0.distcp'}: "), (
        out
    )
    assert why in bad[0] and "manifest.json" not in bad[0].split(": ", 1)[0], bad
    code, out, _ = run(capsys, "verify", str(ck), "--json")
    assert code == 1
    (problem,) = json.loads(out)["4"]
    assert problem.startswith("__0_0.distcp: ") and why in problem, problem


@pytest.mark.parametrize("flipped", ["3", "5", "9"])
def test_verify_fails_a_manifest_whose_format_field_has_a_flipped_bit(
    capsys, checkpoints, tmp_path, flipped
):
    """``"format": 1`` with one bit flipped: its own checksum fails, so it is a damaged
    commit record (exit 1), not a checkpoint a newer unbroken wrote."""
    ck = copy_tree(checkpoints, tmp_path / "ck")
    manifest = ck / step_dir(4) / "manifest.json"
    data = manifest.read_bytes()
    manifest.write_bytes(data.replace(b'"format": 1', f'"format": {flipped}'.encode()))
    code, out, _ = run(capsys, "verify", str(ck))
    assert code == 1, out
    assert f"CORRUPT {manifest}: " in out and "checksum" in out and "newer" not in out
    code, out, _ = run(capsys, "verify", str(ck), "--json")
    assert code == 1
    (problem,) = json.loads(out)["4"]
    assert problem.startswith("manifest.json: ") and "checksum" in problem


def test_verify_says_which_steps_a_newer_unbroken_wrote_and_checks_the_rest(
    capsys, checkpoints, tmp_path
):
    """A step of a newer format (its own checksum sound) is named as not checked, never
    passed over in silence nor called partial; alone, it is no pass."""
    from tests.checkpoint.manager_util import reseal

    ck = copy_tree(checkpoints, tmp_path / "ck")
    reseal(ck / step_dir(4), edit=lambda doc: doc.update(format=2))
    code, out, _ = run(capsys, "verify", str(ck), "--no-progress")
    assert code == 0, out
    assert f"ok      {ck / step_dir(2)}" in out
    assert f"newer   {ck / step_dir(4)}: not checked: " in out and "format 2" in out, out
    code, out, err = run(capsys, "verify", str(ck), "--step", "4", "--no-progress")
    assert code == 1 and "PARTIAL" not in out, out
    assert "step 4 cannot be checked by unbroken" in err and "format 2" in err, err
    shutil.rmtree(ck / step_dir(2))
    code, _, err = run(capsys, "verify", str(ck), "--no-progress")
    assert code == 1 and "1 written by a newer unbroken" in err, err


@pytest.mark.parametrize("verb", ["ls", "verify", "goodput"])
def test_an_empty_directory_is_a_clear_error(capsys, tmp_path, verb):
    code, _out, err = run(capsys, verb, str(tmp_path))
    assert code == 1
    assert err.startswith(f"unbroken {verb}: error: ") or "error:" in err
    assert str(tmp_path) in err


@pytest.mark.parametrize("verb", ["ls", "verify", "goodput"])
def test_a_missing_directory_and_a_missing_url_are_clear_errors(capsys, tmp_path, verb):
    code, _, err = run(capsys, verb, str(tmp_path / "nope"))
    assert code == 1 and "does not exist" in err
    code, _, err = run(capsys, verb)
    assert code == 2 and "required: url" in err


def test_goodput_prints_the_breakdown(capsys, checkpoints, tmp_path):
    code, out, _ = run(capsys, "goodput", str(checkpoints))
    assert code == 0
    assert out.startswith("goodput ") and "0 restarts, 4 steps" in out
    for category in ("productive", "data_wait", "checkpoint_save", "startup", "down"):
        assert category in out
    code, out, _ = run(capsys, "goodput", str(checkpoints), "--json")
    doc = json.loads(out)
    assert {"goodput", "wall_seconds", "restarts", "steps", "seconds", "attempts"} <= set(doc)
    assert doc["restarts"] == 0 and doc["steps"] == 4
    assert sum(doc["seconds"].values()) == pytest.approx(doc["wall_seconds"])


def test_goodput_plot(capsys, checkpoints, tmp_path):
    png = tmp_path / "t.png"
    code, _out, _ = run(capsys, "goodput", str(checkpoints), "--plot", str(png))
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "given, written", [("t", "t.png"), ("t.", "t.png"), (".png", ".png"), ("t.svg", "t.svg")]
)
def test_goodput_plot_path_adds_png_only_where_no_format_is_named(tmp_path, given, written):
    from unbroken.cli.plot import plot_path

    assert plot_path(str(tmp_path / given)) == str(tmp_path / written)


def test_goodput_plot_into_a_folder_named_with_a_slash_makes_it(capsys, checkpoints, tmp_path):
    folder = tmp_path / "plots"
    code, _out, err = run(capsys, "goodput", str(checkpoints), "--plot", f"{folder}/")
    assert code == 0, err
    assert (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_goodput_plot_without_matplotlib_says_what_to_install(
    capsys, checkpoints, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run(capsys, "goodput", str(checkpoints), "--plot", str(tmp_path / "t.png"))
    assert code == 1 and "pip install matplotlib" in err


def test_plan_reproduces_the_published_figures(capsys):
    def plan(*argv):
        code, out, _ = run(capsys, "plan", *argv, "--json")
        assert code == 0
        return json.loads(out)

    assert plan("--gpus", "256", "--days", "30", "--afr", "0.01")["failure_probability"] == (
        pytest.approx(0.19, abs=0.005)
    )
    assert plan("--gpus", "1024", "--days", "30", "--afr", "0.01")["failure_probability"] == (
        pytest.approx(0.57, abs=0.005)
    )
    two_hours = plan("--interruptions-per-day", "8.6", "--interval-minutes", "120")
    assert two_hours["expected_goodput"] == pytest.approx(0.64, abs=0.005)
    half_hour = plan("--interruptions-per-day", "8.6", "--interval-minutes", "30")
    assert half_hour["expected_goodput"] == pytest.approx(0.91, abs=0.005)
    best = plan("--interruptions-per-day", "8.6", "--save-seconds", "60")
    assert best["optimal_interval_minutes"] == pytest.approx(18.3, abs=0.05)


def test_plan_prints_a_huge_figure_by_its_exponent(capsys):
    code, out, _ = run(capsys, "plan", "--interruptions-per-day", "1e-300", "--save-seconds", "10")
    assert code == 0 and "2.19e+151 minutes" in out and max(map(len, out.splitlines())) < 60


def test_plan_prints_an_interval_under_a_minute_in_seconds(capsys):
    """4584 interruptions a day at 6 ms blocked per save printed "0.0 minutes"."""
    argv = ["--interruptions-per-day", "4584", "--save-seconds", "0.006"]
    code, out, _ = run(capsys, "plan", *argv)
    assert code == 0 and "0.0 minutes" not in out and "0.476 seconds" in out, out


@pytest.mark.parametrize(
    "argv",
    [
        ["plan"],
        ["plan", "--gpus", "8"],
        ["plan", "--interruptions-per-day", "8.6"],
        ["plan", "--interval-minutes", "30"],
        ["plan", "--gpus", "x", "--days", "1", "--afr", "0.1"],
        ["plan", "--gpus", "8", "--days", "1", "--afr", "2"],
        ["plan", "--interruptions-per-day", "8.6", "--interval-minutes", "0"],
        ["plan", "--json", "--gpus", "10", "--days", "1e308", "--afr", "0.5"],  # overflows
        ["plan", "--gpus", "1" + "0" * 310, "--days", "1", "--afr", "0.1"],  # no float
        ["plan", "--json", "--interruptions-per-day", "1e-320", "--save-seconds", "10"],
        ["plan", "--gpus", "8", "--days", "inf", "--afr", "0.1"],
        ["plan", "--interruptions-per-day", "1", "--interval-minutes", "1e307"],  # *60 is inf
        ["goodput", "somewhere", "--rank", "-1"],
        # the demo's numbers are checked before it starts anything (it ran torchrun first)
        ["demo", "--steps", "0"],
        ["demo", "--every-steps", "0"],
        ["demo", "--kills", "-1"],
        ["demo", "--files", "16"],
        ["demo", "--step-seconds", "-1"],
        ["demo", "--step-seconds", "1e308"],  # an OverflowError inside torchrun's job
        ["demo", "--steps", "5", "--every-steps", "10"],  # no save before the end
        ["demo", "--steps", "20", "--every-steps", "10"],  # no room for a kill: "OK" anyway
    ],
)
def test_plan_bad_arguments(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and "error:" in err and not out  # never an Infinity printed
    assert "> 0 seconds" not in err  # the user gave minutes


def test_every_verb_has_help(capsys):
    for verb in ("ls", "verify", "goodput", "plan", "demo"):
        code, out, _ = run(capsys, verb, "--help")
        assert code == 0 and f"usage: unbroken {verb}" in out


def test_the_console_script_shows_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    for argv in (["ls"], ["verify", str(tmp_path)], ["goodput", str(tmp_path / "x")], []):
        p = subprocess.run(
            [sys.executable, "-m", "unbroken.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode in (1, 2), (argv, p.returncode)
        assert "Traceback" not in p.stdout + p.stderr
        assert ("error: " if argv else "usage: unbroken") in p.stderr


def test_goodput_of_a_job_still_running_does_not_call_it_crashed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_GOODPUT_FLUSH", "0")  # every event reaches the store at once
    url = str(tmp_path / "live")
    state = {"w": torch.zeros(4)}
    with ub.CheckpointManager(url, staging_dir=tmp_path / "st", every_steps=2) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step, state)
        mgr.wait()
        code, out, _ = run(capsys, "goodput", url)  # the job runs on
        assert code == 0 and "no end yet" in out and "crashed" not in out, out
        assert "still running" in out
    code, out, _ = run(capsys, "goodput", url)
    assert code == 0 and "clean" in out and "no end yet" not in out, out
