"""Retrying remote reads: transient errors (timeouts, dropped connections, 5xx) are retried with
exponential backoff; errors that another attempt cannot fix (missing object, no permission) are not.
The final error is an OSError naming the URL, so the worker's failure record names it too."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")

# What another attempt cannot change: the object is missing or forbidden, or the request itself is wrong.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)


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
    """Whether another attempt may succeed: anything but ``PERMANENT`` and HTTP 4xx statuses (except 408
    and 429, which ask to come back later)."""
    if isinstance(e, PERMANENT):
        return False
    status = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(status, int) and 400 <= status < 500:
        return status in (408, 429)
    return True


def with_retries(fn: Callable[[], T], url: str, policy: RetryPolicy, what: str = "read") -> T:
    """``fn()``, retried under ``policy``; the last failure as an OSError whose text names ``url``."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as e:  # fsspec backends raise their own types (botocore, aiohttp): judged by transient
            if not transient(e):
                err = FileNotFoundError if isinstance(e, FileNotFoundError) else OSError
                raise err(f"{url}: cannot {what} ({type(e).__name__}: {e})") from e
            if attempt + 1 == policy.attempts:
                raise OSError(f"{url}: cannot {what} after {policy.attempts} attempts "
                              f"({type(e).__name__}: {e})") from e
            time.sleep(policy.wait(attempt))
    raise AssertionError("unreachable")
