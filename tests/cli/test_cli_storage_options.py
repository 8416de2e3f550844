"""The CLI's storage options: ls, verify and goodput against a real S3 server (SeaweedFS)
whose endpoint and credentials come only from the command line, never from AWS_*."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import unbroken as ub
from tests.cli.test_cli import (
    ROOT,
    checkpoints,  # noqa: F401 (the fixture, used by name)
    run,
)
from unbroken.cli.errors import CliError


@pytest.fixture(scope="module")
def s3_checkpoints(s3_server, request) -> str:
    """test_cli's checkpoints (2 and 4 committed, 6 partial; goodput events), in S3."""
    local = request.getfixturevalue("checkpoints")
    url = f"s3://{s3_server.new_root()}"
    store = ub.open_store(url, **s3_server.storage_options)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.upload(path, path.relative_to(local).as_posix())
    return url


def cli_options(s3_server) -> list[str]:
    secrets = json.dumps({"key": "testing", "secret": "testing"})
    return [
        "--storage-options", secrets,
        "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
        "--storage-option", "region=us-east-1",
    ]  # fmt: skip


@pytest.fixture
def no_aws_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


def test_ls_verify_goodput_take_the_endpoint_from_the_command_line(
    capsys, s3_server, s3_checkpoints, no_aws_env
):
    options = cli_options(s3_server)
    code, out, err = run(capsys, "ls", s3_checkpoints, *options)
    assert code == 0, err
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["2", "committed"],
        ["4", "committed"],
        ["6", "partial"],
    ]
    code, out, err = run(capsys, "verify", s3_checkpoints, "--no-progress", *options)
    assert code == 0, err
    assert out.count("ok ") == 2
    code, out, err = run(capsys, "goodput", s3_checkpoints, "--json", *options)
    assert code == 0, err
    assert json.loads(out)["steps"] == 4


def test_the_console_script_reaches_the_server_with_options_from_a_file(
    s3_server, s3_checkpoints, tmp_path
):
    options = tmp_path / "options.json"
    options.write_text(json.dumps({**s3_server.storage_options, "skip_instance_cache": True}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    p = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "ls", s3_checkpoints, "--json",
         "--storage-options", f"@{options}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert [c["step"] for c in json.loads(p.stdout)] == [2, 4, 6]


def test_a_missing_bucket_is_named_by_ls(capsys, s3_server, no_aws_env):
    bucket = f"missing-{uuid.uuid4().hex[:10]}"
    code, _out, err = run(capsys, "ls", f"s3://{bucket}/run", *cli_options(s3_server))
    assert code == 1
    assert f"the bucket '{bucket}' does not exist" in err and "attempts" not in err


def test_an_unknown_option_is_a_clear_error(capsys, s3_checkpoints):
    code, _out, err = run(capsys, "ls", s3_checkpoints, "--storage-option", "endpont_url=x")
    assert code == 2 and "unknown storage option 'endpont_url'" in err  # a bad argument


def test_a_local_path_takes_no_options(capsys, tmp_path):
    code, _out, err = run(capsys, "ls", str(tmp_path), "--storage-option", "key=x")
    assert code == 2 and "takes no storage options" in err  # a bad argument


def test_a_retry_option_is_a_policy_or_refused_as_a_bad_argument(capsys):
    """retry={"max_attempts": 1} was taken, then crashed with AttributeError at the
    first failure it was meant to handle; a misspelt field must be refused at once."""
    dead = ["--storage-option", "endpoint_url=http://127.0.0.1:1",
            "--storage-option", "key=k", "--storage-option", 'secret="s"']  # fmt: skip
    code, _out, err = run(capsys, "ls", "s3://bucket/run", *dead,
                          "--storage-option", 'retry={"max_attempts": 1}')  # fmt: skip
    assert code == 3 and "still failing after 1 attempt" in err, err  # nothing read
    code, _out, err = run(capsys, "ls", "s3://bucket/run", *dead,
                          "--storage-option", 'retry={"max_atempts": 1}')  # fmt: skip
    assert code == 2 and "unknown field(s) ['max_atempts']" in err, err


def test_a_local_path_given_a_string_option_gets_no_json_quoting_hint(capsys, tmp_path):
    code, _out, err = run(capsys, "ls", str(tmp_path), "--storage-option", "endpoint_url=http://x")
    assert code == 2 and "takes no storage options" in err and "quote" not in err, err


def test_option_values_parse_as_json_where_they_are_json(tmp_path):
    from unbroken.cli.stores import parse_storage_options

    got = parse_storage_options(
        '{"key": "a", "anon": false}',
        ["anon=true", "secret=s3cr=t", 'client_kwargs={"region_name": "x"}', "n=8"],
    )
    assert got == {
        "key": "a", "anon": True, "secret": "s3cr=t",
        "client_kwargs": {"region_name": "x"}, "n": 8,
    }  # fmt: skip
    path = Path(tmp_path / "o.json")
    path.write_text('{"endpoint_url": "http://h:1"}')
    assert parse_storage_options(f"@{path}", []) == {"endpoint_url": "http://h:1"}
    for blob, pairs, why in [
        ("{not json", [], "not JSON"),
        ("[1]", [], "a JSON object"),
        (f"@{tmp_path}/absent.json", [], "cannot read"),
        (None, ["novalue"], "KEY=VALUE"),
    ]:
        with pytest.raises(CliError, match=why) as info:
            parse_storage_options(blob, pairs)
        assert info.value.code == 2


def test_ls_of_an_unreachable_http_store_is_a_failure_to_reach_it(capsys):
    """Not "no checkpoints": nothing could be listed (retried as a refused connection is)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/run"
    code, _out, err = run(capsys, "ls", url)
    assert code == 3  # the store could not be read: not 1, which says damaged or absent
    assert "no checkpoints" not in err and "Cannot connect" in err


@pytest.mark.parametrize(
    "url",
    ["s3://AKIAEXAMPLE:hunter2@bucket/run", "memory://user:hunter2@host/run", "s4://u:hunter2@b/x"],
)
def test_credentials_in_a_url_are_never_printed(capsys, url):
    for verb in ("ls", "verify", "goodput"):
        code, out, err = run(capsys, verb, url)
        assert code in (1, 2) and "hunter2" not in out + err, (verb, out, err)
        assert "***@" in err
    if url.startswith("s3://"):  # never taken for a bucket named "KEY:SECRET@bucket"
        assert "credentials in the URL are not read" in err


def test_a_secret_that_parses_as_a_number_is_explained(capsys):
    options = ["key=abc", "secret=12345", "endpoint_url=http://127.0.0.1:1"]
    argv = [arg for option in options for arg in ("--storage-option", option)]
    code, _out, err = run(capsys, "ls", "s3://bucket/run", *argv)
    assert code == 2 and """quote a string as KEY='"12345"'""" in err, err
