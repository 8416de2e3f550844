"""Store errors: what failed, where (credentials redacted), and whether to retry.

Classification is a pure function of the exception so the retry loop, the emulated
remote and the tests agree on what "transient" means.
"""

from __future__ import annotations

import errno
import re

# errno values that a network mount or an object store returns while it is briefly
# unhealthy; a retry a moment later usually succeeds.
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable, 503
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError, 500
}
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}
# Exception class names from botocore / aiohttp / urllib3 that mean "the connection
# failed", matched by name so that none of those packages must be importable.
_TRANSIENT_CLASS_NAMES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientConnectionError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ProtocolError",
}


_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


class StoreError(OSError):
    """A store operation failed for good. ``op`` and ``url`` say which."""

    transient = False

    def __init__(self, message: str, *, op: str = "", url: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.url = url

    def __str__(self) -> str:  # OSError's str() would add "[Errno None]"
        return self.args[0] if self.args else ""


class TransientStoreError(StoreError):
    """A failure worth retrying (a dropped connection, a timeout, a 5xx, throttling)."""

    transient = True


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The key (or the bucket) does not exist."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-only write found the key already taken (another writer got there first)."""


class StorePermissionError(StoreError, PermissionError):
    """Credentials or permissions refuse the operation."""


class RetriesExhaustedError(StoreError):
    """A transient failure that kept recurring until the retry budget ran out."""


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` (or what caused it) is a failure a retry may cure."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        verdict = _classify_one(node)
        if verdict is not None:
            return verdict
        node = node.__cause__ or node.__context__
    return False


def _classify_one(exc: BaseException) -> bool | None:
    if isinstance(exc, StoreError):
        return exc.transient
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    if name in _TRANSIENT_CLASS_NAMES:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in _TRANSIENT_S3_CODES or int(status) >= 500 or int(status) == 429
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _TRANSIENT_ERRNOS
    return None


_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s]+@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|"
    r"sig|token|access_key|secret|key|password)=)[^&\s]*"
)


def redact(text: str) -> str:
    """Hide credentials that a URL (or a message quoting one) may carry."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)


def final_error(
    op: str, url: str, exc: BaseException, *, attempts: int = 1, seconds: float = 0.0
) -> StoreError:
    """The error the user sees: names the operation and the (redacted) URL; a transient
    failure retried to the end of its budget also says how long and how to ride out more."""
    safe_url = redact(url)
    cause = redact(f"{type(exc).__name__}: {exc}")
    where = f"{op} {safe_url}"
    if isinstance(exc, StoreError) and not exc.transient and exc.url:
        return exc
    if isinstance(exc, FileExistsError) and op == "create":
        return ObjectExistsError(
            f"{where}: an object already exists there and this create-only write may not "
            f"replace it ({cause})",
            op=op,
            url=safe_url,
        )
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: not found ({cause})", op=op, url=safe_url)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return ObjectNotFoundError(f"{where}: not an object ({cause})", op=op, url=safe_url)
    if isinstance(exc, PermissionError):
        return StorePermissionError(f"{where}: permission denied ({cause})", op=op, url=safe_url)
    if is_transient(exc):
        if attempts == 1:
            return RetriesExhaustedError(
                f"{where}: still failing after 1 attempt ({cause})", op=op, url=safe_url
            )
        return RetriesExhaustedError(
            f"{where}: still failing after {attempts} attempts over {seconds:.1f} s ({cause}); "
            "to ride out longer outages, give the store a longer retry policy: "
            "retry=ub.RetryPolicy(max_attempts=20, max_delay=30) where it is opened (the "
            "dataset, the CheckpointManager), or on the command line --storage-option "
            """'retry={"max_attempts": 20, "max_delay": 30}'""",
            op=op,
            url=safe_url,
        )
    return StoreError(f"{where}: {cause}", op=op, url=safe_url)
