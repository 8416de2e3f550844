"""What an obstore exception means: not found, refused, worth a retry, or final.

obstore raises one class per ``object_store`` error variant (``NotFound``,
``PermissionDenied``, ``Generic``...) and carries nothing else as attributes: the HTTP
status, the kind of transport failure and the server's error code are only in its
message, a first line followed by ``Debug source:`` and the Rust error's debug dump.
That dump's fields are read by name (``status: 503``, ``HttpError { kind: Connect``),
never searched for words: it also holds the retry settings (``retry_timeout: 180s``),
and a search for "timeout" once took every failure for a timeout and retried it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from unbroken.storage.errors import StoreError, TransientStoreError, redact

_DUMP = "\n\nDebug source:"
_STATUS = re.compile(r"\bstatus: (\d{3})\b")
"""The ``Status { status: 404, body: ... }`` of a request the server answered."""
_STATUS_LINE = re.compile(r"non-2xx status code: (\d{3})\b")
"""The same in the first line, for a message without a dump."""
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
"""object_store's ``HttpErrorKind`` of a request that got no answer."""
_CLIENT_KIND = re.compile(r"reqwest::Error \{\s*kind: (\w+)")
_URI = re.compile(r"\buri: Some\(\s*(\S+?),?\s*\)")
_CONNECT = re.compile(r'ConnectError\(\s*"([^"]+)",.*?(?:message|error): "([^"]+)"', re.DOTALL)
"""hyper's ``ConnectError("dns error", ... error: "failed to lookup ...")``: what failed."""
_CODE = re.compile(r"<Code>([^<]+)</Code>")
"""The S3 (and GCS XML) error code in the server's body: NoSuchBucket, SlowDown."""

TRANSIENT_HTTP_KINDS = frozenset({"Connect", "Request", "Timeout", "Interrupted"})
"""The kinds object_store itself retries: the connection failed, broke or timed out.
``Decode`` and ``Unknown`` (a request that could not even be built) are final."""
TRANSIENT_STATUSES = frozenset({408, 429})
"""Besides every 5xx: the server timed the request out, or throttles."""
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_METADATA_PATHS = (
    "/latest/api/token",  # AWS IMDSv2
    "/latest/meta-data/iam/",  # AWS IMDSv1
    "/metadata/identity/oauth2/token",  # Azure
    "/computeMetadata/v1/instance/service-accounts/",  # GCP
)
"""Instance metadata services: where a backend asks for credentials none were given."""


@dataclass(frozen=True)
class NativeFailure:
    """The facts of one failed obstore request, read from its message."""

    summary: str
    """The first line, without the dump and the server's XML body (at most 500 chars)."""
    status: int | None = None
    """The HTTP status the server answered; None if no answer came."""
    http_kind: str | None = None
    """object_store's HttpErrorKind (Connect, Request, Timeout, Interrupted, Decode,
    Unknown) where the request got no answer."""
    client_kind: str | None = None
    """The HTTP client's own error kind (Builder: the request could not be made)."""
    uri: str | None = None
    """The URL the failed request went to."""
    code: str | None = None
    """The error code in the server's body (NoSuchBucket, SlowDown)."""
    cause: str | None = None
    """Why a request got no answer, in words (the first line says only "error sending
    request"): "tcp connect error: Connection refused", "dns error: ...", "timed out"."""

    @property
    def transient(self) -> bool:
        """Whether a retry may cure it: a 5xx, 408 or 429 answer, or a connection that
        failed, broke or timed out. Any other answer (4xx) and any other failure is final."""
        if self.status is not None:
            return self.status >= 500 or self.status in TRANSIENT_STATUSES
        return self.http_kind in TRANSIENT_HTTP_KINDS

    @property
    def credentials_lookup(self) -> bool:
        """The failed request asked an instance metadata service for credentials."""
        return urlsplit(self.uri or "").path.startswith(_METADATA_PATHS)


def parse_failure(text: str) -> NativeFailure:
    """Read an obstore message (first line, then the debug dump) into its facts."""
    head, _, dump = text.partition(_DUMP)
    status = _STATUS.search(dump) or _STATUS_LINE.search(head)
    kind = _HTTP_KIND.search(dump)
    client = _CLIENT_KIND.search(dump)
    uri = _URI.search(dump)
    code = _CODE.search(text)
    connect = _CONNECT.search(dump)
    cause = f"{connect.group(1)}: {connect.group(2)}" if connect else None
    if cause is None and kind is not None and kind.group(1) == "Timeout":
        cause = "timed out"
    return NativeFailure(
        summary=first_line(head),
        status=int(status.group(1)) if status else None,
        http_kind=kind.group(1) if kind else None,
        client_kind=client.group(1) if client else None,
        uri=uri.group(1) if uri else None,
        code=code.group(1) if code else None,
        cause=cause,
    )


def first_line(text: str) -> str:
    """obstore's message without its debug dump and the server's XML body."""
    text = str(text).split(_DUMP, 1)[0].split(": <?xml", 1)[0]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:500] if lines else ""


def translate(exc: BaseException, key: str, bucket: str) -> BaseException | None:
    """The exception to raise instead of obstore's ``exc`` (None: let it pass), with a
    one-line message: FileExistsError, FileNotFoundError and PermissionError for what
    they mean, TransientStoreError for what a retry may cure, StoreError for the rest."""
    if type(exc).__name__ == "PanicException":  # pyo3's: a BaseException, not an Exception
        return StoreError(
            f"obstore failed on {key} (a malformed endpoint or option?): "
            f"{redact(first_line(str(exc)) or 'PanicException')}"
        )
    if not isinstance(exc, (BaseError, FileNotFoundError, PermissionError)):
        return None  # another OSError (a local file obstore read): its errno decides
    failure = parse_failure(str(exc))
    message = redact(failure.summary or type(exc).__name__)
    if failure.cause and failure.status is None:
        message += f" ({redact(failure.cause)})"
    if isinstance(exc, (AlreadyExistsError, PreconditionError)):
        return FileExistsError(f"{key} already exists: {message}")
    if failure.credentials_lookup and not failure.transient:
        return PermissionError(
            f"no credentials: none were given, and asking the instance metadata service "
            f"for them failed ({message}). Give them in storage_options or in the "
            f"backend's environment variables (docs/storage.md)"
        )
    if failure.code in _MISSING_BUCKET_CODES:
        return FileNotFoundError(f"the bucket {bucket!r} does not exist: {message}")
    if isinstance(exc, (NotFoundError, FileNotFoundError)) or failure.status == 404:
        return FileNotFoundError(message)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError, PermissionError)) or (
        failure.status in (401, 403)
    ):
        return PermissionError(message)
    if failure.transient:
        return TransientStoreError(message)
    if failure.client_kind == "Builder" and (failure.uri or "").startswith("http://"):
        message += (
            "; a plain-HTTP endpoint needs allow_http=True in storage_options "
            "(or AWS_ALLOW_HTTP=true, GOOGLE_ALLOW_HTTP, AZURE_ALLOW_HTTP)"
        )
    return StoreError(message)


class native_errors:
    """Raise what :func:`translate` makes of an obstore exception, chained to it."""

    def __init__(self, key: str, bucket: str) -> None:
        self.key = key
        self.bucket = bucket

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or type(exc).__module__.startswith("unbroken"):
            return False
        mapped = translate(exc, self.key, self.bucket)
        if mapped is None:
            return False
        raise mapped from exc
