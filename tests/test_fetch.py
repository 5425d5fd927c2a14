"""sources.fetch's plain GET against a real local HTTP server that misbehaves in one way at a time: each
bound (the per-read timeout, the low-speed rule's windows, the byte cap) fails the transfer when it should
and not before. Times are checked as generous elapsed-time bounds: each limit is set seconds apart from the
others, so the bound that fired is the one the test names."""

from __future__ import annotations

import http.server as http_server
import threading
import time

import pytest

from gpufeed.sources import FetchLimits
from gpufeed.sources.base import TooLarge
from gpufeed.sources.fetch import http_get


class _Misbehaving(http_server.BaseHTTPRequestHandler):
    """/silent: headers and 10 bytes of a declared 1,000, then nothing for 40 s; /burst: 200,000 bytes at once of
    a declared 400,000, then a byte every 0.1 s; /exact-N: a body of N bytes."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        exact = int(self.path.split("-")[1]) if self.path.startswith("/exact-") else None
        self.send_response(200)
        self.send_header("Content-Length", str(exact if exact is not None else 1000 if self.path == "/silent"
                                                else 400_000))
        self.end_headers()
        try:
            if exact is not None:
                self.wfile.write(b"e" * exact)
            elif self.path == "/silent":
                self.wfile.write(b"s" * 10)
                self.wfile.flush()
                time.sleep(40)  # bounded: the client gives up long before
            else:
                self.wfile.write(b"b" * 200_000)
                for _ in range(400):
                    self.wfile.flush()
                    time.sleep(0.1)
                    self.wfile.write(b"d")
        except OSError:
            return


@pytest.fixture(scope="module")
def server():
    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_server_silent_after_its_headers_fails_at_the_read_timeout(server, tmp_path):
    """Nothing comes for longer than ``read_timeout`` (1 s): the transfer fails then, long before the deadline
    (40 s) or the low-speed rule's window (30 s)."""
    began = time.monotonic()
    with pytest.raises(OSError, match="timed out"):
        http_get(f"{server}/silent", str(tmp_path / "f"), FetchLimits(read_timeout=1.0, deadline=40.0))
    assert time.monotonic() - began < 15


def test_the_low_speed_rule_judges_each_window_by_its_own_bytes(server, tmp_path):
    """200 KB at once, then 10 bytes/s: the first 1 s window passes a rule of 1,000 bytes/s, the next fails it,
    though the bytes since the start would pass for minutes; well before the 40 s deadline."""
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"under 1000 bytes/s for 1 s \(2000\d\d bytes came\)"):
        http_get(f"{server}/burst", str(tmp_path / "f"),
                 FetchLimits(deadline=40.0, low_speed=1000, low_speed_time=1.0))
    assert 1.0 < time.monotonic() - began < 15


def test_a_body_of_exactly_the_cap_arrives_and_one_byte_more_is_refused(server, tmp_path):
    path = tmp_path / "f"
    http_get(f"{server}/exact-4096", str(path), FetchLimits(max_bytes=4096))
    assert path.read_bytes() == b"e" * 4096
    with pytest.raises(TooLarge, match="4097 bytes, over the cap of 4096 bytes"):
        http_get(f"{server}/exact-4097", str(path), FetchLimits(max_bytes=4096))


class _Dripping(http_server.BaseHTTPRequestHandler):
    """A byte every 0.05 s of a declared megabyte, for at most 30 s; ``server.served`` counts the bytes written,
    ``server.ended`` is set once the client has gone (a write failed) or the drip ran out."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        try:
            for _ in range(600):
                self.wfile.write(b"d")
                self.wfile.flush()
                self.server.served += 1
                time.sleep(0.05)
        except OSError:  # the client closed the connection
            pass
        finally:
            self.server.ended.set()


def test_an_fsspec_transfer_given_up_at_its_deadline_stops_reading_from_the_server(tmp_path):
    """Through fsspec's HTTP client (aiohttp, as s3fs and gcsfs are): at the 1 s deadline the transfer is
    cancelled, not left running: the client closes the connection, so the server's drip fails within a few of
    its writes instead of being read for its 30 s, and the attempt's file is gone."""
    pytest.importorskip("aiohttp")
    import fsspec

    from gpufeed.sources.fetch import fsspec_get

    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Dripping)
    httpd.daemon_threads, httpd.served, httpd.ended = True, 0, threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        with pytest.raises(TimeoutError, match=r"not complete within the deadline of 1 s \(\d+ bytes came\)"):
            fsspec_get(fs, f"http://127.0.0.1:{httpd.server_address[1]}/shard.tar", str(tmp_path / "shard.tar"),
                       FetchLimits(deadline=1.0, low_speed=0))
        at_deadline = httpd.served
        assert httpd.ended.wait(5), f"still served after the deadline: {httpd.served - at_deadline} more bytes"
        assert httpd.served - at_deadline < 20  # a few writes into the socket's buffers, not the drip's 30 s
        time.sleep(0.3)  # the cancelled task's cleanup runs on the client's loop
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_sync_fsspec_filesystem_is_copied_through_its_open_file(tmp_path):
    """A filesystem without an event loop (fsspec's memory one stands in for sftp, ftp, webhdfs) is copied
    chunk by chunk through the file it opens, the file the waiting side closes to cancel it: the bytes arrive
    whole, a missing object raises its own error, and no attempt's file is left."""
    import fsspec

    from gpufeed.sources.fetch import fsspec_get

    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    data = bytes(range(256)) * 12_289  # more than two 1 MB chunks, not a whole number of them
    fs.pipe("/bucket/shard.tar", data)
    fsspec_get(fs, "memory://bucket/shard.tar", str(tmp_path / "shard.tar"))
    assert (tmp_path / "shard.tar").read_bytes() == data
    with pytest.raises(FileNotFoundError):
        fsspec_get(fs, "memory://bucket/missing.tar", str(tmp_path / "missing.tar"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.tar"]


class _Steady(http_server.BaseHTTPRequestHandler):
    """160,000 bytes, 8 KB every 0.1 s (80 KB/s: slow, steady, well above a 1 KB/s rule), no Content-Length in a
    GET, so a sync client streams it; HEAD gives the size."""

    SIZE = 160_000

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.SIZE))
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for at in range(0, self.SIZE, 8000):
                self.wfile.write(b"s" * 8000)
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass


def test_a_slow_steady_link_through_a_sync_fsspec_client_passes_the_low_speed_rule(tmp_path):
    """fsspec's sync HTTP client (requests, streaming) stands in for sftp, ftp, webhdfs: a link at 80 KB/s shows
    its bytes in every 1.5 s window of a 1 KB/s rule, read in small chunks, and the file arrives whole."""
    pytest.importorskip("requests")
    from fsspec.implementations import http_sync

    from gpufeed.sources.fetch import fsspec_get

    http_sync.unregister()  # its import made it fsspec's http:// filesystem, the other tests' too: used here alone
    HTTPFileSystem = http_sync.HTTPFileSystem

    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Steady)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fs = HTTPFileSystem(block_size=0, skip_instance_cache=True)  # a stream: each read waits for its bytes
        fsspec_get(fs, f"http://127.0.0.1:{httpd.server_address[1]}/shard.tar", str(tmp_path / "shard.tar"),
                   FetchLimits(deadline=30.0, low_speed=1000, low_speed_time=1.5))
        assert (tmp_path / "shard.tar").read_bytes() == b"s" * _Steady.SIZE
        assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.tar"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_async_client_that_writes_after_it_was_given_up_leaves_no_file(tmp_path):
    """An async client slow to stop: cancelled at the deadline, it writes its file after the cancellation's wait
    and ends with an error of its own, not the cancellation. What it wrote is deleted all the same."""
    import asyncio

    from fsspec.asyn import AsyncFileSystem

    from gpufeed.sources.fetch import _CANCEL_WAIT, fsspec_get

    class SlowToStop(AsyncFileSystem):
        async def _get_file(self, rpath, lpath, **kwargs):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(_CANCEL_WAIT + 0.5)
                with open(lpath, "wb") as f:
                    f.write(b"partial")
                raise OSError("transfer aborted") from None

    fs = SlowToStop(skip_instance_cache=True)
    with pytest.raises(TimeoutError, match="deadline of 1 s"):
        fsspec_get(fs, "slow://bucket/shard.tar", str(tmp_path / "shard.tar"), FetchLimits(deadline=1.0, low_speed=0))
    time.sleep(1.5)  # past the client's late write
    assert sorted(p.name for p in tmp_path.iterdir()) == []
