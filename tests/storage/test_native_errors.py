"""The native backend's failures, each met for real, sorted into final and transient.

Final ones (a missing bucket, no credentials, a request that cannot be made) must fail
on the first attempt, naming what is wrong; transient ones (a refused connection, a 5xx,
a request that timed out) must be retried. The count of attempts is the store's own
(``store.stats.retries``), never a clock.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
import uuid

import pytest

from unbroken import open_store
from unbroken.storage import (
    ObjectNotFoundError,
    RetriesExhaustedError,
    RetryPolicy,
    StoreError,
    StorePermissionError,
)
from unbroken.storage.native_errors import parse_failure

FEW = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0)


def no_aws_env(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


def test_a_missing_bucket_fails_at_once_naming_the_bucket(s3_server):
    bucket = f"missing-{uuid.uuid4().hex[:10]}"
    store = open_store(f"s3://{bucket}/run", **s3_server.storage_options)  # default retries
    for op in (store.list, lambda: store.read_bytes("k"), lambda: store.info("k")):
        with pytest.raises(ObjectNotFoundError) as info:
            op()
        assert store.stats.retries == 0  # no retry loop
        assert f"s3://{bucket}/run" in str(info.value)
    with pytest.raises(ObjectNotFoundError, match=f"the bucket '{bucket}' does not exist"):
        store.list()
    assert "Debug source" not in str(info.value)  # one line, not obstore's dump
    assert store.stats.retries == 0


def test_missing_credentials_fail_at_once(s3_server, monkeypatch):
    """No key, no AWS_* variables: the backend asks the instance metadata service, which
    refuses (403): the real server stands in for it, as metadata_endpoint."""
    no_aws_env(monkeypatch)
    store = open_store(
        f"s3://{s3_server.new_root()}",
        endpoint_url=s3_server.endpoint_url,
        region="us-east-1",
        metadata_endpoint=s3_server.endpoint_url,
    )
    with pytest.raises(StorePermissionError, match="no credentials"):
        store.read_bytes("k")
    assert store.stats.retries == 0


def test_a_request_that_cannot_be_made_fails_at_once(s3_server, monkeypatch):
    """An http:// endpoint from AWS_ENDPOINT_URL without AWS_ALLOW_HTTP: obstore's HTTP
    client refuses to build the request ("builder error")."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    store = open_store(f"s3://{s3_server.new_root()}", region="us-east-1")
    with pytest.raises(StoreError, match="allow_http") as info:
        store.read_bytes("k")
    assert not isinstance(info.value, RetriesExhaustedError)
    assert store.stats.retries == 0
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # what the message says works
    store = open_store(store.url, region="us-east-1")
    store.write_bytes("k", b"ok")
    assert store.read_bytes("k") == b"ok"


def test_a_malformed_endpoint_is_refused(s3_server, monkeypatch):
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        open_store("s3://bucket/x", endpoint_url="127.0.0.1:9000", key="k", secret="s")
    # The same from the environment reaches obstore, which panics: a final StoreError,
    # not a BaseException that no `except Exception` catches.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url.removeprefix("http://"))
    store = open_store("s3://bucket/x", region="us-east-1")
    with pytest.raises(StoreError, match="malformed endpoint"):
        store.read_bytes("k")
    assert store.stats.retries == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_retried():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    store = open_store("s3://bucket/x", retry=FEW, endpoint_url=endpoint, key="k", secret="s")
    with pytest.raises(RetriesExhaustedError, match=r"3 attempts over [0-9.]+ s") as raised:
        store.read_bytes("k")
    assert store.stats.retries == 2
    assert "retry=ub.RetryPolicy(" in str(raised.value)  # how to ride out a longer outage
    assert "Connection refused" in str(raised.value)  # not only "error sending request"


def test_a_name_that_does_not_resolve_says_so():
    store = open_store("s3://bucket/x", retry=RetryPolicy(max_attempts=1), key="k", secret="s",
                       endpoint_url="http://no-such-host.invalid:9000")  # fmt: skip
    with pytest.raises(RetriesExhaustedError, match="dns error"):
        store.read_bytes("k")


class _Answer(http.server.BaseHTTPRequestHandler):
    """Answers every request with the server's ``status`` (and an S3 error body), or
    after ``delay`` seconds."""

    def _answer(self) -> None:
        status, code, delay = self.server.answer  # type: ignore[attr-defined]
        self.server.requests += 1  # type: ignore[attr-defined]
        if delay:
            time.sleep(delay)
        body = f"<?xml version='1.0'?><Error><Code>{code}</Code></Error>".encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up (the timeout case)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def answering_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.daemon_threads = True
    server.requests = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (503, "SlowDown", True),
        (500, "InternalError", True),
        (429, "TooManyRequests", True),
        (400, "InvalidRequest", False),
        (403, "AccessDenied", False),
        (404, "NoSuchBucket", False),
    ],
)
def test_server_answers_are_sorted_by_status(answering_server, status, code, transient):
    answering_server.answer = (status, code, 0)
    endpoint = f"http://127.0.0.1:{answering_server.server_port}"
    store = open_store("s3://bucket/x", retry=FEW, endpoint_url=endpoint, key="k", secret="s")
    with pytest.raises(StoreError) as info:
        store.list()
    assert isinstance(info.value, RetriesExhaustedError) == transient
    assert store.stats.retries == (2 if transient else 0)
    assert answering_server.requests == (3 if transient else 1)


def test_a_request_that_times_out_is_retried(answering_server):
    answering_server.answer = (200, "", 5.0)  # answers, but too late
    endpoint = f"http://127.0.0.1:{answering_server.server_port}"
    store = open_store(
        "s3://bucket/x", retry=FEW, endpoint_url=endpoint, key="k", secret="s",
        client_options={"timeout": "200ms"},
    )  # fmt: skip
    with pytest.raises(RetriesExhaustedError, match="timed out"):
        store.read_bytes("k")
    assert store.stats.retries == 2


def test_the_retry_settings_in_a_dump_are_not_a_timeout():
    """A 404 whose dump says ``retry_timeout: 180s``: its status decides, not the word."""
    text = (
        "Generic S3 error: Error performing list request: Error performing GET "
        "http://h/b?list-type=2 in 2ms - Server returned non-2xx status code: 404 Not "
        "Found: <?xml?><Error><Code>NoSuchBucket</Code></Error>\n\nDebug source:\nGeneric {"
        "\n    source: RetryError(\n        RetryErrorImpl {\n            uri: Some(\n"
        "                http://h/b?list-type=2,\n            ),\n            "
        "retry_timeout: 180s,\n            inner: Status {\n                status: 404,"
    )
    failure = parse_failure(text)
    assert (failure.status, failure.code, failure.uri) == (
        404,
        "NoSuchBucket",
        "http://h/b?list-type=2",
    )
    assert not failure.transient
