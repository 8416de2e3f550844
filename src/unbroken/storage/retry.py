"""Exponential backoff with full jitter, bounded in attempts and in total time."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from unbroken.storage.errors import final_error, is_transient, redact

T = TypeVar("T")

log = logging.getLogger(__name__)

SLOW_SECONDS = 5.0
"""An operation still failing after this long says so as it retries (one line per this
long in a process): a hung
endpoint costs up to the deadline (five minutes by default), which a job's log or an
operator at the CLI should not spend in silence. Quick retries (a throttled request)
stay quiet."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard a store tries before a transient failure becomes final."""

    max_attempts: int = 10
    """Attempts in all, the first included. 1 disables retries."""
    base_delay: float = 0.05
    """Seconds before the first retry; doubles on each further one."""
    max_delay: float = 5.0
    """Cap on one backoff sleep, in seconds."""
    deadline: float = 300.0
    """Seconds after an operation's start past which no retry begins, sleeps included
    (an attempt under way is not cut short: the store's own timeouts bound it)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ValueError(f"RetryPolicy delays must be positive: {self}")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Sleep before retry number ``attempt`` (1-based): full jitter in [0, cap]."""
        cap = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return rng.uniform(0, cap)


NO_RETRY = RetryPolicy(max_attempts=1)


def as_retry_policy(value: object) -> RetryPolicy:
    """``value`` as a policy: None is the default, a mapping names its fields (the JSON
    of a CLI's --storage-option retry=...). Anything else is refused now, not at the
    first failure it was meant to ride out."""
    if value is None:
        return RetryPolicy()
    if isinstance(value, RetryPolicy):
        return value
    fields = [f.name for f in dataclasses.fields(RetryPolicy)]
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in fields)
        if unknown:
            raise TypeError(f"retry: unknown field(s) {unknown}; RetryPolicy has {fields}")
        try:
            return RetryPolicy(**value)
        except TypeError as exc:  # a value of the wrong type: '<' not supported ...
            raise TypeError(f"retry {dict(value)!r}: {exc}") from None
    raise TypeError(
        f"retry must be a unbroken.RetryPolicy (or a mapping of its fields {fields}), "
        f"got {type(value).__name__} {value!r}"
    )


_JITTER = random.Random()
"""One jitter source per process; seeding a generator per call costs more than the call."""


class RetryStats:
    """Counts retries so the data loader and benchmarks can report them."""

    def __init__(self) -> None:
        self.retries = 0
        self.failures = 0


def call_with_retry(
    fn: Callable[[], T],
    *,
    op: str,
    url: str,
    policy: RetryPolicy,
    stats: RetryStats | None = None,
    rng: random.Random | None = None,
) -> T:
    """Run ``fn``; retry transient failures per ``policy``; raise a named final error."""
    rng = rng or _JITTER
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            elapsed = time.monotonic() - start
            delay = policy.backoff(attempt, rng)
            retry = (
                is_transient(exc)
                and attempt < policy.max_attempts
                and elapsed + delay < policy.deadline
            )
            if not retry:
                if stats is not None:
                    stats.failures += 1
                raise final_error(op, url, exc, attempts=attempt, seconds=elapsed) from exc
            if stats is not None:
                stats.retries += 1
            if elapsed >= SLOW_SECONDS:
                _report_slow(op, url, exc, attempt, elapsed, policy)
            time.sleep(delay)


def _report_slow(
    op: str, url: str, exc: BaseException, attempt: int, elapsed: float, policy: RetryPolicy
) -> None:
    """At most one line per SLOW_SECONDS in a process: a save's hundred uploads to a
    hung endpoint would each say it."""
    global _said_at, _unsaid
    with _said_lock:
        now = time.monotonic()
        if now - _said_at < SLOW_SECONDS:
            _unsaid += 1
            return
        _said_at, unsaid, _unsaid = now, _unsaid, 0
    cause = " ".join(redact(f"{type(exc).__name__}: {exc}").split())[:200]
    log.warning(
        "%s %s: attempt %d failed, %.0f s in (%s); retrying, up to %d attempts, none begun "
        + "after %.0f s%s",
        op,
        redact(url),
        attempt,
        elapsed,
        cause,
        policy.max_attempts,
        policy.deadline,
        f" ({unsaid} more retries of slow operations since the last such line)" if unsaid else "",
    )


_said_at = -float("inf")
_unsaid = 0
_said_lock = threading.Lock()
