"""One whole remote file to a local path: a plain HTTP GET where the URL allows it, else fsspec.

Streaming a shard through fsspec's async clients (aiohttp under s3fs and fsspec's HTTP filesystem) costs
about 2.5x the CPU per byte of the standard library's blocking GET (0.25 against 0.10 s of CPU for 218 MB
from a local S3 server), CPU the decode workers need: BENCHMARKS.md#data-where-it-lives. So a file goes
through a plain GET of an ``https://`` URL (when no storage options would change the request) or of the
URL the filesystem signs (``fs.sign``: S3 presigned URLs, GCS/Azure signed ones where the credentials
allow), and through ``fs.get_file`` otherwise. The plain GET must prove itself: until it has worked once
in a process, a failure that is not a passing one (those are retried) is tried again through fsspec at once, and if that works the process uses fsspec
from then on (a proxy, a CA bundle or request headers only the fsspec client knows about), so it never
turns a working setup into a failing one.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from typing import Any

from .retry import transient
from .urls import scheme

SIGNED_FOR = 3600  # seconds a signed URL stays valid: one fetch, retries included
_CHUNK = 1 << 20


class Fetcher:
    """Fetches whole files for one spool; ``direct``: None (plain GET untried here), True (it worked), False
    (fsspec only)."""

    def __init__(self, storage_options: dict[str, Any], direct: bool = True) -> None:
        self.storage_options = storage_options
        self.direct: bool | None = None if direct else False

    def get(self, fs, url: str, path: str) -> None:
        """Write ``url``'s bytes to ``path``; raises the transfer's error (OSError, HTTPError, ...)."""
        if self.direct is not False:
            plain = self._plain_url(fs, url)
            if plain is not None:
                try:
                    http_get(plain, path)
                    self.direct = True
                    return
                except Exception as e:
                    if self.direct and isinstance(e, urllib.error.HTTPError) and e.code == 404:
                        raise FileNotFoundError(f"HTTP 404 for {url}") from None
                    if self.direct or transient(e):  # proven here, or a passing failure the retries are for
                        raise
                # not proven here yet: fsspec decides; if it succeeds, the plain GET is not for this setup
                fs.get_file(url, path)
                self.direct = False
                return
        fs.get_file(url, path)

    def _plain_url(self, fs, url: str) -> str | None:
        if scheme(url) in ("http", "https"):
            return None if self.storage_options else url
        try:
            signed = fs.sign(url, expiration=SIGNED_FOR)
        except Exception:  # NotImplementedError, or credentials that cannot sign: fsspec it is
            self.direct = False
            return None
        return signed if scheme(str(signed)) in ("http", "https") else None


def http_get(url: str, path: str, timeout: float = 60.0) -> None:
    """Stream ``url`` into ``path`` with the standard library, through one reused buffer (a fresh 1 MB
    bytes object per read would page-fault its memory in every time); a body shorter than its
    Content-Length raises ``http.client.IncompleteRead``."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with urllib.request.urlopen(url, timeout=timeout) as r, open(path, "wb", buffering=0) as f:
        expected = r.headers.get("Content-Length")
        got = 0
        while n := r.readinto(buf):
            f.write(view[:n])
            got += n
        if expected is not None and got != int(expected):
            raise http.client.IncompleteRead(b"", int(expected) - got)
