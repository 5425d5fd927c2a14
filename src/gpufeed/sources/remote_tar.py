"""Tar shards behind URLs (s3://, gs://, az://, https://, file://), in the WebDataset layout.

Sample i is the k-th image of shard s, where the shards' sample counts are known up front: declared
(``samples_per_shard``), or from the local index cache a previous run (or an indexing pass) wrote. So the
loader starts without opening any shard. Shards are read whole: the ``Spool`` fetches each once into a
local folder ahead of the epoch's order, and workers read members from that copy (their offsets parsed
from its tar headers, once per machine, and kept beside it as JSON). Labels come from each sample's
``<key>.cls`` member; one that holds no integer >= 0 fails its own sample, naming the URL and member.

A shard whose content disagrees with its count fails every read naming the URL and both counts; a shard
cut short fails the samples past the cut, naming the URL and the sample's position. URLs are shown with
their query strings and credentials redacted (``urls.redact``): a presigned URL's signature never reaches an
error, a log or a cache file.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .base import IMG_EXTENSIONS, Groups, digest, refuse_over
from .checksums import ShardChecksums
from .fetch import FetchLimits
from .private import private_dir, read_json, write_json
from .retry import ONCE, RetryPolicy, with_retries
from .spool import Readahead, Spool
from .tar import CLS_BYTES, LEFT_OUT, cls_label, split_labels
from .urls import expand_braces, filesystem, join, redact, scheme, unsigned

_log = logging.getLogger("gpufeed")

DEFAULT = "default"  # index_cache: $GPUFEED_CACHE_DIR/shard-index, else ~/.cache/gpufeed/shard-index
_OPEN_SHARDS = 8  # per worker: local copies held open (an evicted copy stays readable while open)


@dataclass(frozen=True)
class Members:
    """A shard's images in tar order: names, data offsets and sizes, labels (-1: none); lists, which index
    faster than arrays one element at a time. ``bad``: image position -> why its ``.cls`` gives no label;
    ``left_out``: the names of its links, devices and FIFOs named like images, never read (``LEFT_OUT``)."""

    names: list[str]
    offsets: list[int]
    sizes: list[int]
    labels: list[int]
    complete: bool  # False: the tar ended early (a truncated shard)
    bad: dict[int, str] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, value: Any, size: int) -> "Members | None":
        """The members a JSON index (``asdict``) holds for a copy of ``size`` bytes; None unless every field
        has its type and every member lies within the copy."""
        if not isinstance(value, dict) or set(value) != {f.name for f in cls.__dataclass_fields__.values()}:
            return None
        names, offsets, sizes, labels = (value[k] for k in ("names", "offsets", "sizes", "labels"))
        bad, complete, left_out = value["bad"], value["complete"], value["left_out"]
        lists = (names, offsets, sizes, labels)
        if not all(isinstance(x, list) and len(x) == len(names) for x in lists) or not isinstance(complete, bool):
            return None
        if not all(isinstance(n, str) for n in names) or not isinstance(bad, dict):
            return None
        if not isinstance(left_out, list) or not all(isinstance(n, str) for n in left_out):
            return None
        numbers = (offsets, sizes, labels)
        if not all(type(v) is int for x in numbers for v in x) or not all(l >= -1 for l in labels):
            return None
        if not all(0 <= o and 0 <= n and o + n <= size for o, n in zip(offsets, sizes)):
            return None
        try:
            bad = {int(k): str(v) for k, v in bad.items()}
        except ValueError:
            return None
        return cls(names, offsets, sizes, labels, complete, bad, left_out)


def parse_members(path: str | int, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> Members:
    """The image members of the local tar at ``path`` (or open descriptor) and their ``<key>.cls`` labels.

    Reads the 512-byte headers in place (mmap), hopping from one to the next: a tenth of ``tarfile``'s cost,
    which every worker pays for every shard of every epoch. ustar, GNU long names and pax paths; a header
    whose checksum fails, or a member running past the end of the file, ends the shard (``complete=False``).
    """
    images: list[tuple[str, int, int]] = []
    cls_of: dict[str, int | str] = {}  # a label, or why the .cls holds none
    left_out: list[str] = []
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
                if kind in _NOT_FILES and name.lower().endswith(extensions):
                    left_out.append(name)
                continue
            if name.lower().endswith(extensions):
                images.append((name, data, size))
            elif name.endswith(".cls"):
                cls_of[name[: -len(".cls")]] = cls_label(mm[data : data + min(size, CLS_BYTES + 1)], name)
        else:
            complete = pos == total  # no end marker, but ends at a member's boundary
    finally:
        if total:
            mm.close()
    labels, bad = split_labels([cls_of.get(os.path.splitext(n)[0], -1) for n, _, _ in images])
    return Members([n for n, _, _ in images], [o for _, o, _ in images], [s for _, _, s in images], labels,
                   complete, bad, left_out)


_NOT_FILES = (b"1", b"2", b"3", b"4", b"6")  # hard link, symbolic link, character and block device, FIFO


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
    """The members of the spooled shard open at ``fd``: from the JSON index the first worker to read it left
    beside it (``<copy>.members``; never unpickled: checked field by field against the copy), else parsed
    and left there for the others."""
    side = local + ".members"
    size = os.fstat(fd).st_size
    members = Members.from_json(read_json(side), size)
    if members is not None:
        return members
    members = parse_members(fd)
    try:
        write_json(side, asdict(members))
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
        self.shown = [redact(u) for u in self.urls]  # as errors and paths show them
        self.index_cache = default_index_cache() if index_cache == DEFAULT else index_cache
        self._groups = Groups(counts)
        self.counts = self._groups.sizes
        self._open: collections.OrderedDict[int, tuple[int, Members]] = collections.OrderedDict()
        self.checksums: ShardChecksums | None = None  # set: each shard's copy checked on its first read here
        # main process: (url:member, why) of the links, devices and FIFOs named like images in the shards seen
        self.left_out: list[tuple[str, str]] = []
        self._seen: set[str] = set()  # shards whose members left out are counted
        self._seen_lock = threading.Lock()
        self._shard_of = {u: s for s, u in enumerate(self.urls)}
        ref = weakref.WeakMethod  # the spool outlives no source it is given to; no cycle through it
        spool.on_ready, spool.on_drop = _weakly(ref(self._ready)), _weakly(ref(self._passed))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_open=collections.OrderedDict(), left_out=[], _seen=set(), _seen_lock=None)
        return state

    def _ready(self, url: str, fd: int, local: str) -> None:
        """Main process, a fetch thread: the copy of ``url`` is complete, open at ``fd``: checked against the
        manifest now (once per loader on this machine: ``checksums``), before a worker waits on it, and its members counted."""
        if self.checksums is not None and self.checksums.answer(url, fd) is not None:
            return  # changed: the workers refuse it, naming it; its members are not looked at
        self._count_left_out(url, _members(fd, local))

    def _passed(self, url: str, local: str) -> None:
        """Main process: the copy of ``url`` is about to be deleted; its members are counted if they were not
        (a worker fetched it first), from the index the workers left beside it."""
        if url in self._seen or url not in self._shard_of:
            return
        try:
            members = Members.from_json(read_json(local + ".members"), os.stat(local).st_size)
        except OSError:  # gone already
            return
        if members is not None:
            self._count_left_out(url, members)

    def _count_left_out(self, url: str, members: Members) -> None:
        """Each shard's links, devices and FIFOs named like images, once: listed, and said in one warning."""
        with self._seen_lock:
            if url in self._seen:
                return
            self._seen.add(url)
            shown = self.shown[self._shard_of[url]]
            self.left_out += [(f"{shown}:{name}", LEFT_OUT) for name in members.left_out]
        if members.left_out:
            _log.warning("gpufeed: %d members of %s with image names are left out: %s (first: %r); "
                         "loader.stats['left_out'] lists them", len(members.left_out), shown, LEFT_OUT,
                         members.left_out[0])

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(self.counts.tolist())

    def __len__(self) -> int:
        return self._groups.total

    def path(self, index: int) -> str:
        s, k = self._groups.locate(index)
        held = self._open.get(s)
        if held is not None and k < len(held[1].names):
            return f"{self.shown[s]}:{held[1].names[k]}"
        return f"{self.shown[s]}[sample {k}]"

    def _shard(self, s: int) -> tuple[int, Members]:
        held = self._open.get(s)
        if held is not None:
            self._open.move_to_end(s)
            return held  # held only once it passed its check
        url = self.urls[s]
        fd, local = self.spool.open(url)
        if self.checksums is not None:
            try:
                self.checksums.check(url, fd)
            except OSError:
                os.close(fd)
                raise
        members = _members(fd, local)
        expected = int(self.counts[s])
        cache = _cache_path(self.index_cache, url, self.spool.storage_options)
        if len(members.names) > expected or (members.complete and len(members.names) < expected):
            os.close(fd)
            raise OSError(f"{self.shown[s]}: holds {len(members.names)} samples, {expected} expected (the declared "
                          f"samples_per_shard, or a stale index cache entry {cache!r})")
        if members.complete and url not in _recorded:
            write_index_entry(cache, url, os.fstat(fd).st_size, expected)
            _recorded.add(url)
        self._open[s] = held = (fd, members)
        if len(self._open) > _OPEN_SHARDS:
            os.close(self._open.popitem(last=False)[1][0])
        return held

    def read(self, index: int, max_bytes: int | None = None) -> bytes:
        s, k = self._groups.locate(index)
        fd, members = self._shard(s)
        if k >= len(members.names):
            raise OSError(f"{self.shown[s]}: sample {k} missing: the shard ends after {len(members.names)} "
                          f"complete samples of {int(self.counts[s])} (truncated)")
        size = members.sizes[k]
        refuse_over(size, max_bytes, self.path(index))
        data = os.pread(fd, size, members.offsets[k])
        if len(data) != size:
            raise OSError(f"{self.path(index)}: read {len(data)} of {size} bytes")
        return data

    def label(self, index: int) -> int:
        s, k = self._groups.locate(index)
        members = self._shard(s)[1]
        label = members.labels[k] if k < len(members.labels) else -1
        if label < 0:
            if k in members.bad:  # a .cls that holds no label
                raise ValueError(f"{self.shown[s]}:{members.bad[k]}")
            name = members.names[k] if k < len(members.names) else f"sample {k}"
            raise ValueError(f"{self.shown[s]}:{name}: no '{os.path.splitext(name)[0]}.cls' member")
        return label

    def readahead(self, order: Sequence[int]) -> Readahead:
        return self.spool.readahead(self.urls, self._groups.of(order), self.ahead)

    def digest(self) -> str:
        """The shards' URLs (as signed for no one: ``urls.unsigned``) and sample counts, hashed
        (``base.fingerprint``); their labels are in the shards, not read for this."""
        return digest("remote-tar", [unsigned(u) for u in self.urls], self.counts)

    def __del__(self) -> None:
        for fd, _ in self._open.values():
            try:
                os.close(fd)
            except OSError:
                pass


def _weakly(method: weakref.WeakMethod):
    """A call of ``method`` while its object lives, nothing after."""
    def call(*args) -> None:
        bound = method()
        if bound is not None:
            bound(*args)
    return call


def write_index_entry(path: str | None, url: str, size: int, count: int) -> None:
    """Record a shard's size and sample count (atomically; a failure to write only costs the next start)."""
    if path is None or read_index_entry(path, url) == (size, count):
        return
    try:
        write_json(path, {"url": redact(url), "size": size, "samples": count})
    except OSError:
        pass


def read_index_entry(path: str | None, url: str) -> tuple[int, int] | None:
    """(size, samples) recorded for ``url``, or None (also for an entry whose fields are not what they
    should be: the cache is checked, never trusted)."""
    if path is None:
        return None
    entry = read_json(path, limit=1 << 16)
    if not isinstance(entry, dict) or entry.get("url") != redact(url):
        return None
    size, samples = entry.get("size"), entry.get("samples")
    if type(size) is not int or type(samples) is not int or size < 0 or samples < 0:
        return None
    return size, samples


def shard_urls(urls: str | Sequence[str], storage_options: dict[str, Any] | None = None,
               suffix: str = ".tar") -> tuple[list[str], dict[str, int]]:
    """The shard URLs of a brace pattern, a list, or a folder URL (listed once: one request per 1,000
    objects on S3), and the sizes a listing gave (url -> bytes)."""
    if isinstance(urls, str):
        if urls.endswith(suffix) or "{" in urls:
            return expand_braces(urls), {}
        fs = filesystem(urls, storage_options)
        listed = with_retries(lambda: fs.find(urls, detail=True), urls, ONCE, "list the folder")
        files = sorted(n for n, d in listed.items() if n.endswith(suffix) and d.get("type") != "directory")
        if not files:
            raise ValueError(f"no {suffix} files under {redact(urls)!r}")
        found = [join(urls, n) for n in files]
        return found, {u: int(listed[n]["size"]) for u, n in zip(found, files) if listed[n].get("size") is not None}
    return [u for pattern in urls for u in expand_braces(str(pattern))], {}


def remote_tar_source(urls: str | Sequence[str], *, samples_per_shard: int | Sequence[int] | None = None,
                      storage_options: dict[str, Any] | None = None, retry: RetryPolicy = RetryPolicy(),
                      spool_dir: str | None = None, readahead: int = 8, window: int = 4,
                      index_cache: str | None = DEFAULT, direct_get: bool = True,
                      limits: FetchLimits = FetchLimits()) -> RemoteTarSource:
    """Tar shards at ``urls``: a brace pattern (``.../shard-{000000..001023}.tar``), a list of URLs, or a
    folder URL whose ``.tar`` files are the shards (sorted by name).

    Sample counts: ``samples_per_shard`` (one count for every shard, or one per shard) lets the first batch
    come without touching any other shard; otherwise each shard's count comes from the index cache
    (``index_cache``: a folder only this user can write, None for none; written whenever a shard is read
    whole, checked against the listing's sizes when there is one), and shards missing from it are fetched
    and indexed now, eight at a time. A wrong count is found when the shard is read, and fails its samples
    with an error naming the URL.

    ``storage_options`` go to fsspec (endpoint, credentials, ...); ``retry`` governs every fetch, ``limits``
    bounds each plain GET (``fetch.FetchLimits``: deadline, byte cap); ``spool_dir`` holds the local copies
    (a folder only this user can write, ``spool.Spool``; default: a fresh one in this user's temporary
    folder, deleted at exit); ``readahead``: shards fetched ahead of the workers; ``window``: shards whose
    samples the epoch order shuffles together; ``direct_get``: fetch through a plain GET of the URL or of
    the URL the filesystem signs, where that works (``fetch.Fetcher``: less CPU per byte), else through
    fsspec; False: always through fsspec.
    """
    index_cache = usable_index_cache(default_index_cache() if index_cache == DEFAULT else index_cache)
    found, sizes = shard_urls(urls, storage_options)
    if not found:
        raise ValueError(f"no shard URLs in {redact(urls) if isinstance(urls, str) else urls!r}")
    for u in found:
        if scheme(u) is None:
            raise ValueError(f"{u!r} is not a URL (local shards: pass a folder or .tar path)")
    spool = Spool(spool_dir, storage_options, retry, direct_get, limits)
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


def usable_index_cache(path: str | None) -> str | None:
    """``path`` made if missing (mode 0700), or None with a warning when another user could write in it:
    the cache only saves a start's indexing, so one that cannot be trusted is not used."""
    if path is None:
        return None
    try:
        return private_dir(path, "index_cache")
    except OSError as e:
        _log.warning("gpufeed: the shard index cache is not used: %s", e)
        return None


def _cache_path(index_cache: str | None, url: str, storage_options: dict[str, Any]) -> str | None:
    """The index cache file of ``url``, keyed by the object it names (``urls.unsigned``: a presigned URL's
    signature is not part of the key) and the endpoint it is read from (the same bucket name on two
    S3-compatible servers is two shards)."""
    if index_cache is None:
        return None
    kwargs = storage_options.get("client_kwargs") or {}
    endpoint = storage_options.get("endpoint_url") or kwargs.get("endpoint_url") or ""
    key = f"{unsigned(str(endpoint))} {unsigned(url)}"
    return os.path.join(index_cache, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


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
            raise ValueError(f"{redact(u)}: not a complete tar file (it ends after {len(members.names)} images)")
        counts[u] = len(members.names)
        write_index_entry(_cache_path(index_cache, u, spool.storage_options), u, os.path.getsize(local), counts[u])
        spool.drop(u)

    missing = [u for u in urls if u not in counts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(index, missing))
    empty = [u for u in urls if counts[u] == 0]
    if empty:
        raise ValueError(f"no images with an extension in {IMG_EXTENSIONS} in shard {redact(empty[0])!r}")
    return [counts[u] for u in urls]
