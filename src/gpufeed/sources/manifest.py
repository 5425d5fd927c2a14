"""The manifest ``gpufeed shards`` writes beside its shards (``manifest.json``), as the sources read it: each
shard's sample count (and a Parquet file's row-group sizes), so a folder or folder URL of shards opens
without indexing or fetching any shard, and the options the shards were written with (``loader.stats``).

The counts are taken only when every shard's size is the one the manifest gives (a stat, or the folder
URL's one listing); otherwise the shards are counted as they would be without a manifest. A manifest that
is not gpufeed's is ignored with a warning; one that is there but cannot be read raises, naming it. A folder
holding a conversion that began and has not ended (its plan record, no manifest) is refused
(``refuse_unfinished``): its shards are a part of the data set.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .checksums import ShardChecksums
from .fetch import FetchLimits, fsspec_get
from .retry import ONCE, RetryPolicy, with_retries
from .urls import filesystem, is_url, redact, scrub

MANIFEST = "manifest.json"
FORMAT_KEY, FORMAT_VERSION = "gpufeed_shards", 1  # what marks a manifest as gpufeed's, and its layout
# A conversion's progress, kept until it ends; hidden, so listings of shards pass over it. Its plan record,
# written first, marks a destination whose conversion has begun; the manifest, written last, one that ended.
PROGRESS = ".gpufeed-progress"
PLAN_RECORD = f"{PROGRESS}/plan.json"

_log = logging.getLogger("gpufeed")
# a manifest lists each shard in about 200 bytes: over a million shards fit, and json.loads of it stays a few GB
MANIFEST_BYTES = 256 << 20
MANIFEST_RETRY = RetryPolicy(attempts=3, backoff=0.5)  # one small file: a store that keeps failing is said soon


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it: file name, bytes, samples, and a Parquet file's row groups."""

    name: str
    size: int
    samples: int
    row_groups: tuple[int, ...] = ()
    sha256: str | None = None


@dataclass(frozen=True)
class ShardManifest:
    """The parts of a manifest the sources use; ``where``: the file it was read from."""

    where: str
    format: str
    shards: tuple[ShardEntry, ...]
    options: dict[str, Any]
    classes: tuple[str, ...] = ()  # an ImageFolder's class names, label i being classes[i]
    _by_name: dict[str, ShardEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {e.name: e for e in self.shards})

    def entry(self, name: str, size: int) -> ShardEntry | None:
        """The entry of shard ``name`` if the manifest lists it at ``size`` bytes."""
        e = self._by_name.get(name)
        return e if e is not None and size == e.size else None

    @property
    def stats(self) -> dict[str, Any]:
        """What ``loader.stats["shards"]`` reports: the options the shards were written with, and where."""
        return {**self.options, "manifest": self.where}


def manifest_path(folder: str) -> str:
    return folder.rstrip("/") + "/" + MANIFEST if is_url(folder) else os.path.join(folder, MANIFEST)


def read_manifest(folder: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> ShardManifest | None:
    """The manifest in ``folder`` (a path or folder URL), or None when it has none (one GET or open)."""
    where = manifest_path(str(folder))
    try:
        if is_url(where):
            fs = filesystem(where, storage_options)
            text = with_retries(lambda: _read_all(fs, where), where, MANIFEST_RETRY, "read the shard manifest")
        else:
            text = _read_local(where)
    except FileNotFoundError:
        return None
    except PermissionError:  # no credentials (a URL), or a file this user may not read: said as it is
        raise
    except OSError as e:  # there but unreadable: counting its shards without it would hide why
        raise OSError(f"{redact(where)}: the shard manifest is there but cannot be read ({scrub(str(e))}): try again "
                      f"once it can be, or move it away to read the shards without it") from None
    try:
        return parse_manifest(json.loads(text), where)
    except (ValueError, TypeError, KeyError) as e:
        _log.warning("gpufeed: ignoring the shard manifest %s: %s", where, e)
        return None


def _read_local(where: str) -> bytes:
    """The local manifest: a regular file of at most ``MANIFEST_BYTES`` (opened without waiting, so a FIFO
    named so is refused rather than read forever)."""
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError("not a regular file")
        if info.st_size > MANIFEST_BYTES:
            raise OSError(f"{info.st_size} bytes, over the cap of {MANIFEST_BYTES}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MANIFEST_BYTES + 1)
    finally:
        os.close(fd)


def _read_all(fs, where: str) -> bytes:
    """The whole file at ``where``, under the limits every transfer has (``fetch.fsspec_get``)."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-manifest-") as tmp:
        local = os.path.join(tmp, MANIFEST)
        fsspec_get(fs, where, local, FetchLimits(max_bytes=MANIFEST_BYTES))
        with open(local, "rb") as f:
            return f.read()


def refuse_unfinished(folder: str, storage_options: dict[str, Any] | None = None,
                      names: list[str] | None = None) -> None:
    """ValueError when ``folder`` (a path, or a folder URL whose recursive listing ``names`` is given) holds a
    ``gpufeed shards`` conversion that began and has not ended: its plan record and no manifest."""
    if is_url(folder):
        plan = folder.rstrip("/") + "/" + PLAN_RECORD
        held = any(n.rstrip("/").endswith(PLAN_RECORD) for n in names or ())
        if held and not any(n.rstrip("/").endswith("/" + MANIFEST) for n in names or ()):
            _refuse(folder, _read_plan(lambda: filesystem(plan, storage_options).open(plan, "rb")))
        return
    plan = os.path.join(folder, PLAN_RECORD)
    if os.path.isfile(plan) and not os.path.exists(os.path.join(folder, MANIFEST)):
        _refuse(folder, _read_plan(lambda: open(plan, "rb")))


def _read_plan(opener) -> Any:
    try:
        with opener() as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _refuse(folder: str, plan: Any) -> None:
    from .urls import redact

    identity = plan.get("identity") if isinstance(plan, dict) else None
    source = identity.get("source") if isinstance(identity, dict) else None
    of = f" of {source!r}" if isinstance(source, str) else ""
    raise ValueError(f"{redact(folder)!r} holds an unfinished `gpufeed shards` conversion{of} (no {MANIFEST} yet): "
                     f"its shards are a part of the data set. Run the same `gpufeed shards` command again to finish "
                     f"it (the shards already written are kept), or delete {PROGRESS}/ there to read the shards "
                     f"it holds as they are")


def parse_manifest(doc: Any, where: str) -> ShardManifest:
    """A manifest's JSON, checked (ValueError naming ``where`` and what is wrong)."""
    if not isinstance(doc, dict) or doc.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ValueError(f"{where}: not a gpufeed shard manifest of version {FORMAT_VERSION}")
    shards = []
    for s in doc["shards"]:
        sha = s.get("sha256")
        entry = ShardEntry(str(s["name"]), int(s["size"]), int(s["samples"]), tuple(int(r) for r in s.get("row_groups", ())),
                           sha if isinstance(sha, str) else None)
        if "/" in entry.name or entry.name.startswith(".") or entry.samples < 1:
            raise ValueError(f"{where}: bad shard entry {s!r}")
        shards.append(entry)
    classes = doc.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError(f"{where}: classes must be a list of names, got {classes!r}")
    return ShardManifest(where, str(doc["format"]), tuple(shards), dict(doc.get("options", {})), tuple(classes))


def _listing(folder: str, suffix: str, storage_options: dict[str, Any] | None) -> dict[str, int]:
    """{name: bytes} of the files ending with ``suffix`` directly in ``folder`` (one listing for a URL)."""
    if is_url(folder):
        fs = filesystem(folder, storage_options)
        listed = with_retries(lambda: fs.ls(folder, detail=True), folder, ONCE, "list the folder")
        return {d["name"].rstrip("/").rsplit("/", 1)[-1]: int(d["size"]) for d in listed
                if d.get("type") != "directory" and d["name"].endswith(suffix)}
    return {e.name: e.stat().st_size for e in os.scandir(folder)
            if e.is_file() and e.name.endswith(suffix) and not e.name.startswith(".")}


def manifest_source(folder: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """The shards in ``folder`` (a path or folder URL) opened with its manifest's counts, reporting its
    options (``source.shard_options``); None when the folder has no usable manifest or no such shards."""
    from .parquet import parquet_source
    from .remote_tar import remote_tar_source
    from .tar import tar_source

    folder = str(folder)
    manifest = read_manifest(folder, storage_options)
    if manifest is None or manifest.format not in ("tar", "parquet"):
        return None
    sizes = _listing(folder, "." + manifest.format, storage_options)
    if not sizes:
        return None
    names = sorted(sizes)
    paths = [folder.rstrip("/") + "/" + n if is_url(folder) else os.path.join(folder, n) for n in names]
    entries = [manifest.entry(n, sizes[n]) for n in names]
    known = all(e is not None for e in entries)
    if not known:
        stale = next(n for n, e in zip(names, entries) if e is None)
        _log.warning("gpufeed: %s does not list %s at its size: counting the shards as without a manifest",
                     manifest.where, stale)
    if manifest.format == "parquet":
        rows = [list(e.row_groups) for e in entries] if known and all(e.row_groups for e in entries) else None
        source = parquet_source(paths, rows=rows, storage_options=storage_options)
    elif is_url(folder):
        source = remote_tar_source(paths, samples_per_shard=[e.samples for e in entries] if known else None,
                                   storage_options=storage_options)
    else:  # local shards are indexed in place, which gives their counts too
        source = tar_source(folder)
    source.shard_options = manifest.stats
    # what ``verify_checksums=True`` checks each shard against (``checksums``)
    source.manifest_checksums = ShardChecksums({e.name: e.sha256 for e in manifest.shards if e.sha256}, manifest.where)
    if manifest.classes and not getattr(source, "classes", None):  # the class names of the folder converted
        source.classes = manifest.classes
    return source
