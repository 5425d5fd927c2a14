"""URLs where a path is accepted: which strings are URLs, WebDataset brace ranges, and the fsspec
filesystem that opens them (with the extra to install named when its package is missing)."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

# The extra that brings each scheme's fsspec filesystem package.
EXTRAS = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
          "az": ("azure", "adlfs"), "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"),
          "http": ("http", "aiohttp"), "https": ("http", "aiohttp"), "file": ("remote", "fsspec")}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")
REDACTED = "[redacted]"
# a URL inside a message (ends at a space or a quote), and the query parameters that carry a signature or a
# token where they appear outside a URL (botocore and aiohttp messages quote them)
_URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_SECRET_PARAM = re.compile(r"(?i)\b(X-Amz-[A-Za-z-]+|X-Goog-[A-Za-z-]+|Signature|AWSAccessKeyId|Expires|sig|"
                           r"se|sp|sv|st|skoid|sktid|token|access_token|key)=([^&\s'\"]+)")


def scheme(path: str) -> str | None:
    """The URL scheme of ``path`` ("s3", "https", ...), or None for a plain path."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    return isinstance(path, str) and scheme(path) is not None


def redact(url: str) -> str:
    """``url`` as it may be shown (logs, errors, cache files): no user or password, and every query value and
    the fragment replaced by ``[redacted]`` (a presigned URL's query holds its signature; the parameter
    names stay, so a presigned URL still reads as one). Anything that is not a URL comes back as it is."""
    if scheme(url) is None or ("@" not in url and "?" not in url and "#" not in url):
        return url  # the usual case, and a plain path, at no parsing cost
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    if "@" in parts.netloc:
        netloc = f"{REDACTED}@{netloc}"
    query = "&".join(f"{p.partition('=')[0]}={REDACTED}" for p in parts.query.split("&") if p)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, REDACTED if parts.fragment else ""))


def unsigned(url: str) -> str:
    """``url`` without its query string, fragment and credentials: the object it names, the same however
    it was signed (a key for caches)."""
    if scheme(url) is None:
        return url
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def scrub(text: str) -> str:
    """``text`` with every URL in it ``redact``-ed and any signature or token parameter's value replaced."""
    if "://" not in text and "=" not in text:
        return text
    text = _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}={REDACTED}" if m.group(2) != REDACTED else m.group(0), text)


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's shard ranges: ``shard-{000000..000002}.tar`` -> shard-000000.tar, shard-000001.tar,
    shard-000002.tar (zero padding as written; several ranges expand as a product, left to right)."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    lo, hi = m.group(1), m.group(2)
    if int(hi) < int(lo):
        raise ValueError(f"brace range {{{lo}..{hi}}} in {pattern!r} runs backwards")
    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [u for i in range(int(lo), int(hi) + 1) for u in expand_braces(f"{head}{i:0{width}d}{tail}")]


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """The fsspec filesystem for ``url``'s scheme, made with ``storage_options``. Raises ImportError naming
    the pip extra when fsspec or the scheme's package (s3fs, gcsfs, adlfs, aiohttp) is missing."""
    proto = scheme(url) or "file"
    extra, package = EXTRAS.get(proto, ("remote", f"the fsspec implementation of {proto}://"))
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"reading {redact(url)!r} needs fsspec: pip install 'gpufeed[{extra}]'") from None
    try:
        return fsspec.filesystem(proto, **(storage_options or {}))
    except ImportError as e:
        raise ImportError(f"reading {redact(url)!r} needs {package}: pip install 'gpufeed[{extra}]' ({e})") from None
    except (ValueError, TypeError) as e:  # fsspec: "Protocol not known"; an option the filesystem does not take
        keys = ", ".join(sorted(map(str, storage_options or {}))) or "none"
        raise ValueError(f"cannot open {redact(url)!r} with storage_options keys {keys} "
                         f"({type(e).__name__}: {scrub(str(e))})") from None


def scheme_status(proto: str) -> str:
    """Whether ``proto``:// URLs can be opened here, for ``gpufeed info``."""
    extra, package = EXTRAS.get(proto, ("remote", proto))
    try:
        import fsspec
    except ImportError:
        missing = f"pip install 'gpufeed[{extra}]' for fsspec"
    else:
        try:
            fsspec.get_filesystem_class(proto)
            return "yes"
        except ImportError:
            missing = f"pip install 'gpufeed[{extra}]' for {package}"
        except ValueError:
            return "no (fsspec does not know it)"
    if proto in ("http", "https"):  # tar shards there are fetched with the standard library (fetch.Fetcher)
        return f"tar shards only, by a plain GET ({missing}: Parquet files, storage_options)"
    return f"no ({missing})"


def join(base: str, name: str) -> str:
    """``name`` (a path as a filesystem lists it, without scheme) as a URL with ``base``'s scheme."""
    proto = scheme(base)
    if proto is None or scheme(name) is not None:
        return name
    return f"{proto}://{name.lstrip('/')}" if proto not in ("file",) else f"file://{name}"
