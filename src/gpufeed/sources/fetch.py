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

Every transfer, a plain GET or fsspec's, has a low-speed rule, an overall deadline and a byte cap
(``FetchLimits``): a transfer under ``low_speed`` bytes/s for ``low_speed_time`` seconds (curl's
``--speed-limit``/``--speed-time``) or past the deadline fails as a passing failure (retried), a body over the
cap as a permanent one, instead of holding a fetch thread for the deadline or forever, or filling the disk. A
stalled server thus fails an attempt within a minute by default, while a slow but steady one finishes. An
fsspec transfer is watched by the caller through the size of the file it writes (``fsspec_get``): one given up
is cancelled at once (an async client's task on its loop, a sync client's file closed under it), so the
server is no longer read from, and what it wrote is deleted. A body over the cap is never handed over to fsspec.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .base import TooLarge
from .private import open_file
from .retry import transient
from .urls import redact, scheme

SIGNED_FOR = 3600  # seconds a signed URL stays valid: one fetch, retries included
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FetchLimits:
    """Bounds on each plain GET of a whole file: ``deadline`` seconds for the whole transfer (a 1 GB shard
    at 4 MB/s fits), ``read_timeout`` seconds for the server to send anything at all, a transfer slower than
    ``low_speed`` bytes/s over ``low_speed_time`` seconds given up (a stalled server, not a slow link: 1 KB/s is
    a thousandth of a poor one), ``max_bytes`` for the body (far above any real shard or Parquet file)."""

    deadline: float = 300.0
    read_timeout: float = 60.0
    low_speed: int = 1024
    low_speed_time: float = 30.0
    max_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        if not isinstance(self.low_speed, int) or isinstance(self.low_speed, bool) or self.low_speed < 0:
            raise ValueError(f"low_speed must be an integer number of bytes/s >= 0 (0: no rule), got {self.low_speed!r}")
        for name in ("deadline", "read_timeout", "low_speed_time"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {self.max_bytes!r}")


def version_of(headers: Mapping[str, Any]) -> str | None:
    """What tells one version of a stored object from another, from its response headers or an fsspec
    ``info``: the ETag (quotes and a weak mark dropped), else the Last-Modified date of a plain HTTP server;
    None when the store gives neither."""
    etag = headers.get("ETag") or headers.get("etag")
    if etag:
        return "etag:" + str(etag).removeprefix("W/").strip('"')
    modified = headers.get("Last-Modified")
    return f"modified:{modified}" if isinstance(modified, str) and modified else None


class Fetcher:
    """Fetches whole files for one spool; ``direct``: None (plain GET untried here), True (it worked), False
    (fsspec only)."""

    def __init__(self, storage_options: dict[str, Any], direct: bool = True,
                 limits: FetchLimits = FetchLimits()) -> None:
        self.storage_options, self.limits = storage_options, limits
        self.direct: bool | None = None if direct else False

    def get(self, filesystem: Callable[[], Any], url: str, path: str) -> str | None:
        """Write ``url``'s bytes to ``path``; the object's version as the GET saw it (``version_of``; None
        through fsspec). ``filesystem()`` gives the fsspec filesystem, asked for only when one is needed: a
        plain ``http(s)://`` GET needs none, nor aiohttp. Raises the transfer's error (OSError, HTTPError, ...)."""
        if self.direct is not False:
            plain = self._plain_url(filesystem, url)
            if plain is not None:
                try:
                    version = http_get(plain, path, self.limits)
                    self.direct = True
                    return version
                except Exception as e:
                    if self.direct and isinstance(e, urllib.error.HTTPError) and e.code == 404:
                        raise FileNotFoundError(f"HTTP 404 for {redact(url)}") from None
                    # proven here, a passing failure the retries are for, or the object itself over the cap
                    if self.direct or transient(e) or isinstance(e, TooLarge):
                        raise
                    failure = e
                # not proven here yet: fsspec decides; if it succeeds, the plain GET is not for this setup
                try:
                    fs = filesystem()
                except ImportError:  # no fsspec client here to try instead: the GET's own failure stands
                    raise failure from None
                fsspec_get(fs, url, path, self.limits)
                self.direct = False
                return None
        fsspec_get(filesystem(), url, path, self.limits)
        return None

    def _plain_url(self, filesystem: Callable[[], Any], url: str) -> str | None:
        if scheme(url) in ("http", "https"):
            return None if self.storage_options else url
        try:
            signed = filesystem().sign(url, expiration=SIGNED_FOR)
        except Exception:  # NotImplementedError, or credentials that cannot sign: fsspec it is
            self.direct = False
            return None
        return signed if scheme(str(signed)) in ("http", "https") else None


def http_get(url: str, path: str, limits: FetchLimits = FetchLimits()) -> str | None:
    """Stream ``url`` into ``path`` with the standard library, through one reused buffer (a fresh 1 MB
    bytes object per read would page-fault its memory in every time); the object's version
    (``version_of``). A body shorter than its Content-Length raises ``http.client.IncompleteRead``; one
    over ``limits.max_bytes`` raises ``TooLarge`` (before any byte is read when its Content-Length says so);
    a transfer not complete within ``limits.deadline``, or under ``limits.low_speed`` bytes/s for
    ``limits.low_speed_time`` seconds, raises ``TimeoutError``. Each read takes what one receive gives, so a
    server that drips is seen as it drips."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    shown = redact(url)
    with urllib.request.urlopen(url, timeout=limits.read_timeout) as r:
        length = r.headers.get("Content-Length")
        expected = int(length) if length is not None else None
        if expected is not None and expected > limits.max_bytes:
            raise TooLarge(f"{shown}: {expected} bytes, over the cap of {limits.max_bytes} bytes per request")
        # the deadline cuts the connection: a drip of one byte at a time never lets a read time out
        cut = threading.Event()
        timer = threading.Timer(limits.deadline, _cut, (r, cut))
        timer.daemon = True
        timer.start()
        got = 0
        window, window_got = time.monotonic(), 0  # the low-speed rule's current window
        try:
            with os.fdopen(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb", buffering=0) as f:
                while n := r.readinto1(buf):
                    got += n
                    if got > limits.max_bytes:
                        raise TooLarge(f"{shown}: more than the cap of {limits.max_bytes} bytes per request")
                    f.write(view[:n])
                    now = time.monotonic()
                    if now - window >= limits.low_speed_time:
                        if got - window_got < limits.low_speed * (now - window):
                            raise TimeoutError(f"{shown}: under {limits.low_speed} bytes/s for "
                                               f"{limits.low_speed_time:g} s ({got} bytes came)")
                        window, window_got = now, got
        except (OSError, http.client.HTTPException, ValueError):
            if not cut.is_set():  # else the read failed because the deadline cut the connection: said below
                raise
        finally:
            timer.cancel()
        if cut.is_set():
            raise TimeoutError(f"{shown}: not complete within the deadline of {limits.deadline:g} s ({got} bytes came)")
        if expected is not None and got != expected:
            raise http.client.IncompleteRead(b"", expected - got)
        return version_of(r.headers)


_WATCH = 0.25  # seconds between looks at an fsspec transfer's progress
_CANCEL_WAIT = 2.0  # seconds a cancelled async transfer is given to close its file, so it is deleted here
_COPY_CHUNK = 1 << 16  # a sync copy's reads: small enough that a slow link shows progress in each low-speed window


def fsspec_get(fs: Any, url: str, path: str, limits: FetchLimits = FetchLimits()) -> None:
    """``fs.get_file(url, path)`` under ``limits``, as ``http_get`` applies them: the transfer writes beside
    ``path`` and is watched from here by what it read (``_Transfer.progress``), moved to ``path`` once complete.
    A transfer past the deadline or under the low-speed rule raises ``TimeoutError``, one over the byte cap
    ``TooLarge``; either way it is cancelled at once (``_Transfer``), so the client stops reading from the
    server, and what it wrote is deleted. Each attempt writes a file of its own, so a cancelled transfer never
    touches a later attempt's."""
    partial = f"{path}.{secrets.token_hex(6)}.fsspec"
    transfer = _Transfer(fs, url, partial)
    shown, start = redact(url), time.monotonic()
    window, window_got = start, 0  # the low-speed rule's current window
    try:
        while not transfer.wait(_WATCH):
            now, got = time.monotonic(), transfer.progress()
            if got > limits.max_bytes:
                raise TooLarge(f"{shown}: more than the cap of {limits.max_bytes} bytes per request")
            if now - start >= limits.deadline:
                raise TimeoutError(f"{shown}: not complete within the deadline of {limits.deadline:g} s "
                                   f"({got} bytes came)")
            if now - window >= limits.low_speed_time:
                if got - window_got < limits.low_speed * (now - window):
                    raise TimeoutError(f"{shown}: under {limits.low_speed} bytes/s for {limits.low_speed_time:g} s "
                                       f"({got} bytes came)")
                window, window_got = now, got
    except BaseException:
        transfer.cancel()
        raise
    if transfer.failure is not None:
        _unlink(partial)
        raise transfer.failure
    if _size(partial) > limits.max_bytes:
        _unlink(partial)
        raise TooLarge(f"{shown}: more than the cap of {limits.max_bytes} bytes per request")
    os.replace(partial, path)


class _Transfer:
    """One ``get_file`` of ``url`` into ``partial``, started at once and cancellable from the waiting thread. An
    async filesystem's (s3fs, gcsfs, adlfs, fsspec's HTTP) runs as a task on the filesystem's own loop, which
    ``cancel`` cancels: its response is closed, the connection with it. A sync one's is copied here chunk by
    chunk from ``fs.open`` in a thread of its own, which ``cancel`` stops at the next chunk and whose file object
    it closes. A local filesystem's copy has nothing remote to stop and runs as ``get_file``. A cancelled
    transfer deletes what it wrote when it ends."""

    def __init__(self, fs: Any, url: str, partial: str) -> None:
        self.partial, self.failure = partial, None
        self.read = 0  # bytes a sync copy has read so far (an async client's are judged by its file)
        self._done, self._given_up = threading.Event(), threading.Event()
        self._started, self._ended = threading.Event(), threading.Event()  # an async transfer's task ran, and ended
        self._future: Any = None
        self._source: Any = None  # a sync filesystem's open remote file
        if getattr(fs, "async_impl", False) and hasattr(fs, "_get_file"):
            self._future = asyncio.run_coroutine_threadsafe(self._get_async(fs, url), fs.loop)
            self._future.add_done_callback(lambda _: self._done.set())
        else:
            threading.Thread(target=self._get_sync, args=(fs, url), daemon=True, name="gpufeed-fsspec-get").start()

    async def _get_async(self, fs: Any, url: str) -> None:
        self._started.set()
        try:
            await fs._get_file(url, self.partial)
        except asyncio.CancelledError:
            self._given_up.set()  # cancelled from anywhere: nobody waits for it
            raise
        except BaseException as e:  # handed to the caller, which raises it (unless it gave up)
            self.failure = e
        finally:
            if self._given_up.is_set():  # however the client ended, what it wrote goes; its file is closed by now
                _unlink(self.partial)
            self._ended.set()

    def _get_sync(self, fs: Any, url: str) -> None:
        try:
            if _local(fs):
                fs.get_file(url, self.partial)
            else:
                self._copy(fs, url)
        except BaseException as e:  # handed to the caller, which raises it (unless it gave up)
            self.failure = e
        finally:
            self._done.set()
            if self._given_up.is_set():  # nobody waits for it: what it wrote goes
                _unlink(self.partial)

    def _copy(self, fs: Any, url: str) -> None:
        with fs.open(url, "rb") as source:
            self._source = source
            if self._given_up.is_set():  # cancelled while it opened
                return
            with os.fdopen(open_file(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
                while not self._given_up.is_set() and (chunk := source.read(_COPY_CHUNK)):
                    out.write(chunk)
                    self.read += len(chunk)

    def progress(self) -> int:
        """Bytes transferred so far: those a sync copy read, or those written where the client writes the file."""
        return max(self.read, _size(self.partial))

    def wait(self, timeout: float) -> bool:
        """Whether the transfer ended (either way) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop the transfer now: the async task cancelled on its loop, or the sync copy's file closed under it."""
        self._given_up.set()
        if self._future is not None:
            self._future.cancel()
            if self._started.is_set():  # a task cancelled before it ran never opened the file
                self._ended.wait(_CANCEL_WAIT)  # its client closes the file as the cancellation unwinds it
            _unlink(self.partial)
            return
        source = self._source
        if source is not None:
            try:
                source.close()  # a read under way fails, or the next one does
            except Exception:  # a client that cannot close from another thread: the copy stops at its next chunk
                pass
        if self._done.is_set():
            _unlink(self.partial)


def _local(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", ())
    return bool({"file", "local"} & set((protocol,) if isinstance(protocol, str) else protocol))


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:  # not made yet: the client is still waiting for the first byte
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _cut(response: Any, cut: threading.Event) -> None:
    """Shut the response's connection down from the timer's thread, which wakes the read blocked on it."""
    cut.set()
    try:
        sock = socket.socket(fileno=os.dup(response.fileno()))
    except (OSError, ValueError):  # already closed: the transfer ended meanwhile
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
