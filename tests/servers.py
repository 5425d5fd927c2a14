"""Real servers for the remote-data tests, started in the test run: moto's S3 server (the S3 REST API over
HTTP, reached through s3fs) and the standard library's HTTP server (with 503s), each with a request log; and
what those tests share: a fast retry policy, an index cache of each test's own, the samples they serve."""

from __future__ import annotations

import collections
import functools
import http.server
import re
import threading
import urllib.parse
from pathlib import Path

import pytest

from gpufeed.sources import RetryPolicy, folder_source

FAST = RetryPolicy(attempts=2, backoff=0.05, max_wait=0.1)


@pytest.fixture(autouse=True)
def own_index_cache(tmp_path, monkeypatch):
    """Each test's remote indexes in a cache of its own (autouse in the modules that import it)."""
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def src(synth_root):
    """The synthetic folder's samples, which the servers hold as shards."""
    return folder_source(synth_root)


class S3Server:
    """moto's S3 application served on a free port in a thread (any access key is accepted); ``requests``:
    (method, path, access key) of every request, in order; ``stop``/``start`` keep the buckets (they live in
    this process) and the log."""

    def __init__(self) -> None:
        moto_server = pytest.importorskip("moto.server")
        pytest.importorskip("s3fs")
        self._app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)
        self._handler = moto_server.MotoRequestHandler
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.port = 0
        self.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # s3fs's own retries off: the loader's retry policy is what the tests exercise
        self.storage_options = {"key": "test", "secret": "test",
                                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                                "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}}}
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test",
                                   aws_secret_access_key="test", region_name="us-east-1")

    def _logged(self, environ, start_response):
        # the access key: in the Authorization header, or a presigned URL's X-Amz-Credential or AWSAccessKeyId
        signed = environ.get("HTTP_AUTHORIZATION", "") + " " + urllib.parse.unquote(environ.get("QUERY_STRING", ""))
        key = re.search(r"(?:Credential|AWSAccessKeyId)=([^/&\s]+)", signed)
        with self._lock:
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), key and key.group(1)))
        return self._app(environ, start_response)

    def gets(self, key: str, suffix: str = "") -> list[str]:
        """The paths (``/bucket/key``, no query) of the GETs signed with access key ``key`` ending with
        ``suffix``, in order."""
        with self._lock:
            return [p for m, p, k in self.requests if m == "GET" and k == key and p.endswith(suffix)]

    def bucket(self, name: str) -> None:
        self.client.create_bucket(Bucket=name)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def start(self) -> None:
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", self.port, self._logged, threaded=True, request_handler=self._handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        with server.lock:
            server.requests.append(self.path)
            server.ranges.append(self.headers.get("Range"))
            server.agents.append(self.headers.get("User-Agent", ""))
            failing = server.fail_left[self.path] > 0
            if failing:
                server.fail_left[self.path] -= 1
        if failing:
            self.send_error(server.fail_code[self.path], "Failing on purpose")
            return
        super().do_GET()


class HttpServer:
    """``http.server`` serving ``root`` on a free port in a thread. ``fail(path, n)``: the next ``n`` GETs of
    ``path`` answer 503; ``requests``: the paths asked for, in order; ``ranges``: their Range headers; ``agents``: their User-Agents."""

    def __init__(self, root: Path) -> None:
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
        self._httpd.requests = []
        self._httpd.ranges = []
        self._httpd.agents = []
        self._httpd.fail_left = collections.Counter()
        self._httpd.fail_code: dict[str, int] = {}
        self._httpd.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list[str]:
        return self._httpd.requests

    @property
    def ranges(self) -> list[str | None]:
        return self._httpd.ranges

    @property
    def agents(self) -> list[str]:
        """The User-Agent of each request: which client fetched."""
        return self._httpd.agents

    def failures_left(self, path: str) -> int:
        return self._httpd.fail_left[path]

    def fail(self, path: str, n: int, code: int = 503) -> None:
        """The next ``n`` GETs of ``path`` answer HTTP ``code``."""
        with self._httpd.lock:
            self._httpd.fail_left[path] = n
            self._httpd.fail_code[path] = code

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def shards_over_http(root: Path, src, per_shard: int = 5) -> "HttpServer":
    """``src``'s samples as WebDataset shards of ``per_shard`` written under ``root`` and served over HTTP:
    {url}/shard-000.tar, ... (sample i in shard i // per_shard); ``server.root`` and ``server.pattern`` (the
    brace range) say where."""
    from gpufeed.synth import tar_shards

    root.mkdir()
    shards = list(tar_shards(src, per_shard))
    for s, data in enumerate(shards):
        (root / f"shard-{s:03d}.tar").write_bytes(data)
    server = HttpServer(root)
    server.root = root
    server.pattern = f"{server.url}/shard-{{000..{len(shards) - 1:03d}}}.tar"
    return server
