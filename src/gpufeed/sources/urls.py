"""URLs where a path is accepted: which strings are URLs, WebDataset brace ranges, and the fsspec
filesystem that opens them (with the extra to install named when its package is missing)."""

from __future__ import annotations

import re
from typing import Any

# The extra that brings each scheme's fsspec filesystem package.
EXTRAS = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
          "az": ("azure", "adlfs"), "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"),
          "http": ("http", "aiohttp"), "https": ("http", "aiohttp"), "file": ("remote", "fsspec")}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")


def scheme(path: str) -> str | None:
    """The URL scheme of ``path`` ("s3", "https", ...), or None for a plain path."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    return isinstance(path, str) and scheme(path) is not None


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
        raise ImportError(f"reading {url!r} needs fsspec: pip install 'gpufeed[{extra}]'") from None
    try:
        return fsspec.filesystem(proto, **(storage_options or {}))
    except ImportError as e:
        raise ImportError(f"reading {url!r} needs {package}: pip install 'gpufeed[{extra}]' ({e})") from None
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ValueError(f"cannot open {url!r}: {e}") from None


def scheme_status(proto: str) -> str:
    """Whether ``proto``:// URLs can be opened here, for ``gpufeed info``."""
    extra, package = EXTRAS.get(proto, ("remote", proto))
    try:
        import fsspec
    except ImportError:
        return f"no (pip install 'gpufeed[{extra}]' for fsspec)"
    try:
        fsspec.get_filesystem_class(proto)
    except ImportError:
        return f"no (pip install 'gpufeed[{extra}]' for {package})"
    except ValueError:
        return "no (fsspec does not know it)"
    return "yes"


def join(base: str, name: str) -> str:
    """``name`` (a path as a filesystem lists it, without scheme) as a URL with ``base``'s scheme."""
    proto = scheme(base)
    if proto is None or scheme(name) is not None:
        return name
    return f"{proto}://{name.lstrip('/')}" if proto not in ("file",) else f"file://{name}"
