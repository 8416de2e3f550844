"""Classification of failures (pure) and redaction of credentials in messages."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from unbroken.storage.errors import (
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorePermissionError,
    TransientStoreError,
    final_error,
    is_transient,
    redact,
)
from unbroken.storage.retry import RetryPolicy, call_with_retry


def client_error(code: str, status: int) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError(),
        TimeoutError(),
        OSError(errno.EBUSY, "SlowDown"),
        OSError(errno.EREMOTEIO, "InternalError"),
        OSError(errno.ETIMEDOUT, "timed out"),
        client_error("SlowDown", 503),
        client_error("InternalError", 500),
        client_error("Whatever", 502),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        TransientStoreError("x"),
    ],
)
def test_transient_failures(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(),
        PermissionError(),
        IsADirectoryError(),
        OSError(errno.ENOSPC, "disk full"),
        OSError(errno.EINVAL, "bad request"),
        client_error("AccessDenied", 403),
        client_error("NoSuchBucket", 404),
        ValueError("bad"),
    ],
)
def test_permanent_failures(exc):
    assert not is_transient(exc)


def test_the_cause_chain_is_classified():
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_transient(outer)


def test_redaction_hides_credentials():
    text = "s3://AKIAXXX:supersecret@bucket/key?X-Amz-Signature=abc123&part=2 and https://u:p@h/x"
    out = redact(text)
    assert "supersecret" not in out and "abc123" not in out and "u:p@" not in out
    assert "s3://***@bucket/key" in out and "part=2" in out


def test_final_errors_name_operation_and_url():
    url = "s3://AKIA:secret@bucket/prefix/k"
    err = final_error("read_bytes", url, FileNotFoundError("gone"))
    assert isinstance(err, ObjectNotFoundError) and isinstance(err, FileNotFoundError)
    assert str(err).startswith("read_bytes s3://***@bucket/prefix/k: not found")
    assert isinstance(final_error("upload", url, PermissionError()), StorePermissionError)
    exhausted = final_error("upload", url, ConnectionResetError(), attempts=5)
    assert isinstance(exhausted, RetriesExhaustedError)
    assert "5 attempts" in str(exhausted) and "secret" not in str(exhausted)


def test_call_with_retry_counts_and_stops_on_permanent():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        if len(calls) == 3:
            raise FileNotFoundError("now it is gone")
        return "never"

    with pytest.raises(ObjectNotFoundError):
        call_with_retry(flaky, op="op", url="u", policy=RetryPolicy(base_delay=0.001))
    assert len(calls) == 3


def test_backoff_is_exponential_capped_and_jittered():
    import random

    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    rng = random.Random(0)
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (12, 1.0)]:
        draws = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in draws)
        assert max(draws) > cap * 0.8 and min(draws) < cap * 0.2  # jitter spans the range
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize(
    "url, scheme",
    [("s4://bucket/ckpt", "s4"), ("htps://host/volume", "htps"), ("simplecache::s4://b/x", "s4")],
)
def test_a_mistyped_url_scheme_is_named_as_such(url, scheme):
    """fsspec alone says "Protocol not known: s4", naming neither the URL nor a way on."""
    from unbroken import open_store

    with pytest.raises(ValueError, match=rf"'{url}'.*unknown URL scheme '{scheme}'.*s3://"):
        open_store(url)


def test_a_url_short_of_a_slash_is_refused_not_taken_for_a_local_folder(tmp_path, monkeypatch):
    """``s3:/bucket/run`` was a local folder named ``s3:``: checkpoints on the node's disk,
    lost with it."""
    from unbroken import open_store
    from unbroken.storage import LocalStore

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"one slash.*did you mean 's3://bucket/run'"):
        open_store("s3:/bucket/run")
    assert not (tmp_path / "s3:").exists()
    assert isinstance(open_store("./s3:/bucket/run"), LocalStore)  # the way named for a folder
    assert open_store(f"file:{tmp_path}").root == str(tmp_path)  # RFC 8089's file:/path


def test_a_cache_chain_over_a_local_path_is_no_unknown_scheme(tmp_path):
    from unbroken import open_store

    (tmp_path / "a").write_bytes(b"x")
    assert open_store(f"simplecache::{tmp_path}").read_bytes("a") == b"x"


def test_a_protocol_registered_with_fsspec_as_a_class_is_accepted():
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from unbroken import open_store

    class TeamFS(MemoryFileSystem):
        protocol = "teamfs-unbroken-test"

    fsspec.register_implementation("teamfs-unbroken-test", TeamFS)
    store = open_store("teamfs-unbroken-test://vol")
    store.write_bytes("a", b"x")
    assert store.read_bytes("a") == b"x"
