"""Retrying remote reads: transient errors (timeouts, dropped connections, 5xx, 408, 429) are retried
with exponential backoff; errors that another attempt cannot fix are not: a missing or forbidden object
(4xx), a certificate that fails verification, an object over its byte cap, and programming errors. The
final error is an OSError naming the URL (its query string and credentials redacted), so the worker's
failure record names it too."""

from __future__ import annotations

import random
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from .base import TooLarge
from .urls import redact, scrub

T = TypeVar("T")

# What another attempt cannot change: the object is missing, forbidden or too large, the request itself is
# wrong, or the code making it is.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TooLarge,
             TypeError, AttributeError, NameError, LookupError, AssertionError, NotImplementedError, ImportError,
             ArithmeticError, RecursionError)


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the wait before try k+1 is ``backoff * 2**k`` seconds (+- 25% jitter),
    capped at ``max_wait``. The defaults ride out about 15 s of an unreachable server."""

    attempts: int = 6
    backoff: float = 0.5
    max_wait: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff < 0 or self.max_wait < 0:
            raise ValueError(f"backoff and max_wait must be >= 0 seconds, got {self.backoff}, {self.max_wait}")

    def wait(self, attempt: int) -> float:
        return min(self.max_wait, self.backoff * 2**attempt) * random.uniform(0.75, 1.25)


def transient(e: BaseException) -> bool:
    """Whether another attempt may succeed: not for ``PERMANENT`` errors, certificate failures, or HTTP
    4xx statuses (except 408 and 429, which ask to come back later), wherever they sit in the chain of
    errors that wrapped them (``__cause__``, urllib's ``reason``)."""
    for err in _wrapped(e):
        if isinstance(err, PERMANENT) or _bad_certificate(err):
            return False
        status = getattr(err, "status", None) or getattr(err, "code", None)
        if isinstance(status, int) and 400 <= status < 500:
            return status in (408, 429)
    return True


def _wrapped(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        reason = getattr(err, "reason", None)
        err = err.__cause__ or (reason if isinstance(reason, BaseException) else None)


def _bad_certificate(e: BaseException) -> bool:
    """A TLS certificate that failed verification: the standard library's error, or a client's own type for
    it (aiohttp's ClientConnectorCertificateError, botocore's SSLError quoting OpenSSL's reason)."""
    return (isinstance(e, ssl.SSLCertVerificationError) or type(e).__name__.endswith("CertificateError")
            or "CERTIFICATE_VERIFY_FAILED" in str(e))


def with_retries(fn: Callable[[], T], url: str, policy: RetryPolicy, what: str = "read") -> T:
    """``fn()``, retried under ``policy``; the last failure as an OSError whose text names ``url`` (redacted,
    as is the failure's own text)."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as e:  # fsspec backends raise their own types (botocore, aiohttp): judged by transient
            why = f"{type(e).__name__}: {scrub(str(e))}"
            if not transient(e):
                err = FileNotFoundError if isinstance(e, FileNotFoundError) else OSError
                raise err(f"{redact(url)}: cannot {what} ({why})") from None
            if attempt + 1 == policy.attempts:
                raise OSError(f"{redact(url)}: cannot {what} after {policy.attempts} attempts ({why})") from None
            time.sleep(policy.wait(attempt))
    raise AssertionError("unreachable")
