"""Tar shards behind URLs (s3://, gs://, az://, https://, file://), in the WebDataset layout.

Sample i is the k-th image of shard s, where the shards' sample counts are known up front: declared
(``samples_per_shard``), or from the local index cache a previous run (or an indexing pass) wrote. So the
loader starts without opening any shard. Shards are read whole: the ``Spool`` fetches each once into a
local folder ahead of the epoch's order, and workers read members from that copy (their offsets parsed
from its tar headers, once per process). Labels come from each sample's ``<key>.cls`` member.

A shard whose content disagrees with its count fails every read naming the URL and both counts; a shard
cut short fails the samples past the cut, naming the URL and the sample's position.
"""

from __future__ import annotations

import collections
import hashlib
import json
import mmap
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence


from .base import IMG_EXTENSIONS, Groups
from .retry import RetryPolicy
from .spool import Readahead, Spool
from .urls import expand_braces, filesystem, join, scheme

DEFAULT = "default"  # index_cache: $GPUFEED_CACHE_DIR/shard-index, else ~/.cache/gpufeed/shard-index
_OPEN_SHARDS = 8  # per worker: local copies held open (an evicted copy stays readable while open)


@dataclass(frozen=True)
class Members:
    """A shard's images in tar order: names, data offsets and sizes, labels (-1: none); lists, which index
    faster than arrays one element at a time."""

    names: list[str]
    offsets: list[int]
    sizes: list[int]
    labels: list[int]
    complete: bool  # False: the tar ended early (a truncated shard)


def parse_members(path: str | int, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> Members:
    """The image members of the local tar at ``path`` (or open descriptor) and their ``<key>.cls`` labels.

    Reads the 512-byte headers in place (mmap), hopping from one to the next: a tenth of ``tarfile``'s cost,
    which every worker pays for every shard of every epoch. ustar, GNU long names and pax paths; a header
    whose checksum fails, or a member running past the end of the file, ends the shard (``complete=False``).
    """
    images: list[tuple[str, int, int]] = []
    cls_of: dict[str, int] = {}
    with open(path, "rb", closefd=not isinstance(path, int)) as f:
        total = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if total else b""
    complete, pos, long_name = False, 0, None
    try:
        while pos + 512 <= total:
            hdr = mm[pos : pos + 512]
            if hdr.count(0) == 512:  # the end-of-archive marker
                complete = True
                break
            size = _number(hdr[124:136])
            if size is None or _number(hdr[148:156]) != sum(hdr[:148]) + 256 + sum(hdr[156:]):
                break  # not a tar header: corrupt or cut short
            data, kind = pos + 512, hdr[156:157]
            pos = data + (size + 511) // 512 * 512
            if data + size > total:
                break
            if kind == b"L":  # GNU long name of the next member
                long_name = mm[data : data + size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            if kind in (b"x", b"g"):  # pax extended header: its "path" names the next member
                long_name = _pax_path(mm[data : data + size]) or long_name
                continue
            name = long_name or _header_name(hdr)
            long_name = None
            if kind not in (b"0", b"\0", b"7"):
                continue
            if name.lower().endswith(extensions):
                images.append((name, data, size))
            elif name.endswith(".cls"):
                try:
                    cls_of[name[: -len(".cls")]] = int(mm[data : data + size].strip())
                except ValueError:
                    cls_of[name[: -len(".cls")]] = -1
        else:
            complete = pos == total  # no end marker, but ends at a member's boundary
    finally:
        if total:
            mm.close()
    return Members([n for n, _, _ in images], [o for _, o, _ in images], [s for _, _, s in images],
                   [cls_of.get(os.path.splitext(n)[0], -1) for n, _, _ in images], complete)


def _number(field: bytes) -> int | None:
    """A tar header's numeric field: octal text, or GNU base-256 for large sizes."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    text = field.replace(b"\0", b" ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        return None


def _header_name(hdr: bytes) -> str:
    name = hdr[:100].split(b"\0", 1)[0]
    if hdr[257:262] == b"ustar":
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_path(records: bytes) -> str | None:
    """The ``path`` of pax records (``"<length> <key>=<value>\\n"`` ...)."""
    pos = 0
    while pos < len(records):
        space = records.find(b" ", pos)
        if space < 0:
            return None
        try:
            length = int(records[pos:space])
        except ValueError:
            return None  # not pax records: the header's own name stands
        if length <= space - pos:  # a record shorter than its own length field: never step back or stand still
            return None
        key, _, value = records[space + 1 : pos + length - 1].partition(b"=")
        if key == b"path":
            return value.decode("utf-8", "surrogateescape")
        pos += length
    return None


_recorded: set[str] = set()  # shards whose count this process has put in the index cache


def _members(fd: int, local: str) -> Members:
    """The members of the spooled shard open at ``fd``: from the index the first worker to read it left
    beside it (``<copy>.members``), else parsed and left there for the others."""
    side = local + ".members"
    try:
        with open(side, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError):
        pass
    members = parse_members(fd)
    try:
        tmp = f"{side}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(members, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, side)
    except OSError:  # only the other workers' time is lost
        pass
    return members


class RemoteTarSource:
    """Samples in tar shards at ``urls`` with ``counts[s]`` images in shard s (picklable).

    ``groups``: the shards' sample counts, so the sampler orders the epoch shard by shard (``sampling``);
    ``readahead(order)`` (main process) fetches ahead along an order of sample indices.
    """

    def __init__(self, urls: Sequence[str], counts: Sequence[int], spool: Spool, *, ahead: int = 8,
                 window: int = 4, index_cache: str | None = DEFAULT) -> None:
        if len(urls) != len(counts):
            raise ValueError(f"{len(urls)} shard URLs but {len(counts)} sample counts")
        self.urls, self.spool, self.ahead, self.window = list(urls), spool, ahead, window
        self.index_cache = default_index_cache() if index_cache == DEFAULT else index_cache
        self._groups = Groups(counts)
        self.counts = self._groups.sizes
        self._open: collections.OrderedDict[int, tuple[int, Members]] = collections.OrderedDict()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = collections.OrderedDict()
        return state

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(self.counts.tolist())

    def __len__(self) -> int:
        return self._groups.total

    def path(self, index: int) -> str:
        s, k = self._groups.locate(index)
        held = self._open.get(s)
        if held is not None and k < len(held[1].names):
            return f"{self.urls[s]}:{held[1].names[k]}"
        return f"{self.urls[s]}[sample {k}]"

    def _shard(self, s: int) -> tuple[int, Members]:
        held = self._open.get(s)
        if held is not None:
            self._open.move_to_end(s)
            return held
        url = self.urls[s]
        fd, local = self.spool.open(url)
        members = _members(fd, local)
        expected = int(self.counts[s])
        cache = _cache_path(self.index_cache, url, self.spool.storage_options)
        if len(members.names) > expected or (members.complete and len(members.names) < expected):
            os.close(fd)
            raise OSError(f"{url}: holds {len(members.names)} samples, {expected} expected (the declared "
                          f"samples_per_shard, or a stale index cache entry {cache!r})")
        if members.complete and url not in _recorded:
            write_index_entry(cache, url, os.fstat(fd).st_size, expected)
            _recorded.add(url)
        self._open[s] = held = (fd, members)
        if len(self._open) > _OPEN_SHARDS:
            os.close(self._open.popitem(last=False)[1][0])
        return held

    def read(self, index: int) -> bytes:
        s, k = self._groups.locate(index)
        fd, members = self._shard(s)
        if k >= len(members.names):
            raise OSError(f"{self.urls[s]}: sample {k} missing: the shard ends after {len(members.names)} "
                          f"complete samples of {int(self.counts[s])} (truncated)")
        size = members.sizes[k]
        data = os.pread(fd, size, members.offsets[k])
        if len(data) != size:
            raise OSError(f"{self.path(index)}: read {len(data)} of {size} bytes")
        return data

    def label(self, index: int) -> int:
        s, k = self._groups.locate(index)
        members = self._shard(s)[1]
        label = members.labels[k] if k < len(members.labels) else -1
        if label < 0:
            name = members.names[k] if k < len(members.names) else f"sample {k}"
            raise ValueError(f"{self.urls[s]}:{name}: no '{os.path.splitext(name)[0]}.cls' member holding an "
                             "integer label")
        return label

    def readahead(self, order: Sequence[int]) -> Readahead:
        return self.spool.readahead(self.urls, self._groups.of(order), self.ahead)

    def __del__(self) -> None:
        for fd, _ in self._open.values():
            try:
                os.close(fd)
            except OSError:
                pass


def write_index_entry(path: str | None, url: str, size: int, count: int) -> None:
    """Record a shard's size and sample count (atomically; a failure to write only costs the next start)."""
    if path is None or read_index_entry(path, url) == (size, count):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"url": url, "size": size, "samples": count}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_index_entry(path: str | None, url: str) -> tuple[int, int] | None:
    """(size, samples) recorded for ``url``, or None."""
    if path is None:
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    return (entry["size"], entry["samples"]) if entry.get("url") == url else None


def shard_urls(urls: str | Sequence[str], storage_options: dict[str, Any] | None = None,
               suffix: str = ".tar") -> tuple[list[str], dict[str, int]]:
    """The shard URLs of a brace pattern, a list, or a folder URL (listed once: one request per 1,000
    objects on S3), and the sizes a listing gave (url -> bytes)."""
    if isinstance(urls, str):
        if urls.endswith(suffix) or "{" in urls:
            return expand_braces(urls), {}
        fs = filesystem(urls, storage_options)
        listed = fs.find(urls, detail=True)
        files = sorted(n for n, d in listed.items() if n.endswith(suffix) and d.get("type") != "directory")
        if not files:
            raise ValueError(f"no {suffix} files under {urls!r}")
        found = [join(urls, n) for n in files]
        return found, {u: int(listed[n]["size"]) for u, n in zip(found, files) if listed[n].get("size") is not None}
    return [u for pattern in urls for u in expand_braces(str(pattern))], {}


def remote_tar_source(urls: str | Sequence[str], *, samples_per_shard: int | Sequence[int] | None = None,
                      storage_options: dict[str, Any] | None = None, retry: RetryPolicy = RetryPolicy(),
                      spool_dir: str | None = None, readahead: int = 8, window: int = 4,
                      index_cache: str | None = DEFAULT, direct_get: bool = True) -> RemoteTarSource:
    """Tar shards at ``urls``: a brace pattern (``.../shard-{000000..001023}.tar``), a list of URLs, or a
    folder URL whose ``.tar`` files are the shards (sorted by name).

    Sample counts: ``samples_per_shard`` (one count for every shard, or one per shard) lets the first batch
    come without touching any other shard; otherwise each shard's count comes from the index cache
    (``index_cache``: a folder, None for none; written whenever a shard is read whole, checked against the listing's sizes when
    there is one), and shards missing from it are fetched and indexed now, eight at a time. A wrong count
    is found when the shard is read, and fails its samples with an error naming the URL.

    ``storage_options`` go to fsspec (endpoint, credentials, ...); ``retry`` governs every fetch;
    ``spool_dir`` holds the local copies (default: a temporary folder, deleted at exit); ``readahead``: shards
    fetched ahead of the workers; ``window``: shards whose samples the epoch order shuffles together;
    ``direct_get``: fetch through a plain GET of the URL or of the URL the filesystem signs, where that
    works (``fetch.Fetcher``: less CPU per byte), else through fsspec; False: always through fsspec.
    """
    index_cache = default_index_cache() if index_cache == DEFAULT else index_cache
    found, sizes = shard_urls(urls, storage_options)
    if not found:
        raise ValueError(f"no shard URLs in {urls!r}")
    for u in found:
        if scheme(u) is None:
            raise ValueError(f"{u!r} is not a URL (local shards: pass a folder or .tar path)")
    spool = Spool(spool_dir, storage_options, retry, direct_get)
    if samples_per_shard is not None:
        counts = [samples_per_shard] * len(found) if isinstance(samples_per_shard, int) else list(samples_per_shard)
        if len(counts) != len(found) or min(counts) < 1:
            raise ValueError(f"samples_per_shard must be an integer >= 1 or one such per shard ({len(found)} "
                             f"shards), got {samples_per_shard!r}")
    else:
        counts = _counts(found, sizes, spool, index_cache)
    return RemoteTarSource(found, counts, spool, ahead=readahead, window=window, index_cache=index_cache)


def default_index_cache() -> str:
    """Where shards' sample counts are kept between runs: ``$GPUFEED_CACHE_DIR/shard-index``, by default
    under ``~/.cache/gpufeed``."""
    base = os.environ.get("GPUFEED_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpufeed")
    return os.path.join(base, "shard-index")


def _cache_path(index_cache: str | None, url: str, storage_options: dict[str, Any]) -> str | None:
    """The index cache file of ``url``, keyed by the URL and the endpoint it is read from (the same bucket
    name on two S3-compatible servers is two shards)."""
    if index_cache is None:
        return None
    kwargs = storage_options.get("client_kwargs") or {}
    endpoint = storage_options.get("endpoint_url") or kwargs.get("endpoint_url") or ""
    return os.path.join(index_cache, hashlib.sha256(f"{endpoint} {url}".encode()).hexdigest()[:32] + ".json")


def _counts(urls: list[str], sizes: dict[str, int], spool: Spool, index_cache: str | None) -> list[int]:
    """Each shard's sample count: from the index cache where it has the shard (at the listed size), else by
    fetching and indexing the shard now."""
    counts: dict[str, int] = {}
    for u in urls:
        entry = read_index_entry(_cache_path(index_cache, u, spool.storage_options), u)
        if entry is not None and (u not in sizes or sizes[u] == entry[0]):
            counts[u] = entry[1]

    def index(u: str) -> None:
        local = spool.local(u)
        members = parse_members(local)
        if not members.complete:
            raise ValueError(f"{u}: not a complete tar file (it ends after {len(members.names)} images)")
        counts[u] = len(members.names)
        write_index_entry(_cache_path(index_cache, u, spool.storage_options), u, os.path.getsize(local), counts[u])
        spool.drop(u)

    missing = [u for u in urls if u not in counts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(index, missing))
    empty = [u for u in urls if counts[u] == 0]
    if empty:
        raise ValueError(f"no images with an extension in {IMG_EXTENSIONS} in shard {empty[0]!r}")
    return [counts[u] for u in urls]
