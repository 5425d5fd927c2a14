"""Retrying remote reads: transient errors (timeouts, dropped connections, 5xx, 408, 429) are retried
with exponential backoff; errors that another attempt cannot fix are not: a missing or forbidden object
(4xx), missing credentials or ones the store refused, a certificate that fails verification, an object
over its byte cap, and programming errors. The final error is an OSError naming the URL (its query string
and credentials redacted), so the worker's failure record names it too; a refusal is a PermissionError
that says where credentials come from.

gpufeed's retries are the only ones on the calls it retries: the filesystem those calls go through is made
with its client's own retries off (``single_attempt``), so ``RetryPolicy`` alone sets how long a failing
store is tried.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from .base import TooLarge
from .urls import redact, scheme, scrub

T = TypeVar("T")
_log = logging.getLogger("gpufeed")

# What another attempt cannot change: the object is missing, forbidden or too large, the request itself is
# wrong, or the code making it is.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TooLarge,
             TypeError, AttributeError, NameError, LookupError, AssertionError, NotImplementedError, ImportError,
             ArithmeticError, RecursionError)


# The types clients raise when they found no credentials or their token could not be had (botocore,
# google-auth, azure-identity and azure-core): the next attempt would look in the same places.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                             "NoAuthTokenError", "DefaultCredentialsError", "RefreshError",
                             "CredentialUnavailableError", "ClientAuthenticationError"})
# S3's error codes for credentials it refused (botocore's ClientError, when s3fs has not translated it)
_REFUSED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                            "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
                            "InvalidSecurity", "AuthorizationHeaderMalformed", "Forbidden"})
# Where each scheme's credentials come from: the way out of a refusal.
_CREDENTIALS_FROM = {
    "s3": "credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws, or "
          "storage_options {'key': ..., 'secret': ...}; storage_options {'anon': True} reads a public bucket",
    "gs": "credentials come from GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`, or "
          "storage_options {'token': ...}; storage_options {'token': 'anon'} reads a public bucket",
    "az": "credentials come from storage_options {'account_name': ..., and 'account_key', 'sas_token' or "
          "'credential'} or the AZURE_STORAGE_* environment variables",
    "http": "the server refused the request: storage_options {'headers': {'Authorization': ...}} sends a "
            "token (through fsspec)",
}
_SCHEME_FAMILY = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "https": "http"}


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the wait before try k+1 is ``backoff * 2**k`` seconds (+- 25% jitter),
    capped at ``max_wait``; no try starts once the wait before it would end past ``deadline`` seconds from the
    first (None: no such bound). A retry is said in a warning naming the URL (``with_retries``). The defaults
    ride out about 15 s of an unreachable server, and give up on a call within ``deadline`` plus one attempt's
    own bound."""

    attempts: int = 6
    backoff: float = 0.5
    max_wait: float = 10.0
    deadline: float | None = 600.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff < 0 or self.max_wait < 0:
            raise ValueError(f"backoff and max_wait must be >= 0 seconds, got {self.backoff}, {self.max_wait}")
        if self.deadline is not None and (isinstance(self.deadline, bool) or not (
                isinstance(self.deadline, (int, float)) and self.deadline > 0)):
            raise ValueError(f"deadline must be > 0 seconds or None, got {self.deadline!r}")

    def wait(self, attempt: int) -> float:
        return min(self.max_wait, self.backoff * 2**attempt) * random.uniform(0.75, 1.25)


ONCE = RetryPolicy(attempts=1)  # a call not retried, whose failure still names its URL


def transient(e: BaseException) -> bool:
    """Whether another attempt may succeed: not for ``PERMANENT`` errors, missing or refused credentials
    (``refused``), certificate failures, or HTTP 4xx statuses (except 408 and 429, which ask to come back
    later), wherever they sit in the chain of errors that wrapped them (``__cause__``, urllib's ``reason``)."""
    if refused(e):
        return False
    for err in _wrapped(e):
        if isinstance(err, PERMANENT) or _bad_certificate(err):
            return False
        status = _status(err)
        if status is not None and 400 <= status < 500:
            return status in (408, 429)
    return True


def refused(e: BaseException) -> bool:
    """Whether ``e`` (or an error it wraps) says the client has no credentials, or the store refused the
    ones it sent: a PermissionError from the store (s3fs's for 403; one naming a local file is the spool's own
    folder), a client's no-credentials type, HTTP 401 or 403, or S3's code for it."""
    for err in _wrapped(e):
        if isinstance(err, PermissionError) and err.filename is None:
            return True
        if type(err).__name__ in _NO_CREDENTIALS or _status(err) in (401, 403):
            return True
        response = getattr(err, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") in _REFUSED_CODES:
            return True
    return False


def _status(err: BaseException) -> int | None:
    """The HTTP status an error carries: urllib's and aiohttp's ``code``/``status``, botocore's response."""
    status = getattr(err, "status", None) or getattr(err, "code", None)
    if isinstance(status, int):
        return status
    response = getattr(err, "response", None)
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return status if isinstance(status, int) else None


def single_attempt(url: str, storage_options: dict) -> dict:
    """``storage_options`` for a filesystem whose calls gpufeed retries: for S3, botocore's retries off
    (s3fs's are turned off on the filesystem itself, ``single_attempt_fs``), so each of ``RetryPolicy``'s
    attempts is one request and its deadline is the one that holds. A retry setting the options already
    give stays."""
    if _family(url) != "s3":
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    # an instance of gpufeed's own, not fsspec's cached one: single_attempt_fs changes it
    return {**storage_options, "config_kwargs": config, "skip_instance_cache": True}


def single_attempt_fs(fs) -> None:
    """s3fs's own retry loop (``S3FileSystem.retries``, 5 attempts) down to one, on a filesystem made with
    ``single_attempt``'s options (an instance no one else holds)."""
    if type(fs).__name__ == "S3FileSystem":
        fs.retries = 1


def _family(url: str) -> str | None:
    proto = scheme(url)
    return _SCHEME_FAMILY.get(proto, proto)


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


def with_retries(fn: Callable[[], T], url: str, policy: RetryPolicy, what: str = "read",
                 first: Callable[[], bool] | None = None) -> T:
    """``fn()``, retried under ``policy``; the last failure as an OSError whose text names ``url`` (redacted, as
    is the failure's own text). Each retry is said in a warning naming ``url``; with ``first`` (whether no
    process has said a retry of ``url`` yet: ``spool.Spool``), only the first, the others at DEBUG level, so
    a URL that several workers fetch is said once, not once per worker."""
    start = time.monotonic()
    for attempt in range(policy.attempts):
        try:
            return fn()
        except ImportError:  # a package to install (urls.filesystem names it and the URL), not a remote failure
            raise
        except Exception as e:  # fsspec backends raise their own types (botocore, aiohttp): judged by transient
            why = f"{type(e).__name__}: {scrub(str(e))}"
            if refused(e):
                family = _family(url)
                how = _CREDENTIALS_FROM.get(family or "", "check the file's permissions" if family in (None, "file")
                                            else "check the credentials given for it")
                raise PermissionError(f"{redact(url)}: cannot {what}: no credentials, or access refused ({why}); "
                                      f"not retried: {how}") from None
            if not transient(e):
                err = FileNotFoundError if isinstance(e, FileNotFoundError) else OSError
                raise err(f"{redact(url)}: cannot {what} ({why})") from None
            if attempt + 1 == policy.attempts:
                after = f" after {policy.attempts} attempts" if policy.attempts > 1 else ""
                raise OSError(f"{redact(url)}: cannot {what}{after} ({why})") from None
            wait, spent = policy.wait(attempt), time.monotonic() - start
            if policy.deadline is not None and spent + wait >= policy.deadline:
                raise OSError(f"{redact(url)}: cannot {what} after {attempt + 1} attempt(s) in {spent:.1f} s: another "
                              f"would start past the retry deadline of {policy.deadline:g} s ({why})") from None
            said = first is None or first()
            _log.log(logging.WARNING if said else logging.DEBUG, "gpufeed: %s: cannot %s (%s); attempt %d of %d in "
                     "%.1f s%s", redact(url), what, why, attempt + 2, policy.attempts, wait,
                     "" if first is None or not said else "; its further retries are logged at DEBUG level")
            time.sleep(wait)
    raise AssertionError("unreachable")
