"""Shards checked against their manifest's sha256 as the loader reads them (``verify_checksums=True``).

A shard is hashed once per machine, not once per worker: the answer (the sha256 of one file, keyed by its
device, inode, size, mtime and ctime) is kept in a private folder every process of the loader shares (the
spool's, for remote shards and Parquet files; a fresh one for local tar shards), under a per-shard lock, so
the workers that open a shard together wait for one hashing and take its answer. A remote shard is hashed
by the loader's fetch threads as soon as its copy lands, ahead of the workers; a local one by the first
process to open it. A file changed since (a copy fetched again, a rewrite, even one with its mtime set back)
has another key and is hashed again. ``hashed()`` counts the hashings (``loader.stats["shards_hashed"]``):
a read-through each, cheap beside decoding (BENCHMARKS.md#robustness-costs). A shard whose bytes are not
the ones ``gpufeed shards`` wrote fails every sample read from it, with an error naming the shard, the
manifest and the ways out; under ``on_error="skip"`` those samples are skipped and counted like any other
bad sample.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import os
from typing import Mapping

from .private import append_log, open_file, read_json, read_log, write_json
from .urls import redact, unsigned

_CHUNK = 1 << 20
HASHED_LOG = "hashed.log"  # in the shared folder: one line per shard hashed, by any process


def shard_name(path: str) -> str:
    """The name a manifest lists a shard by: its file name (a URL's, without query or credentials)."""
    return os.path.basename(unsigned(path).rstrip("/"))


class ShardChecksums:
    """The sha256 of each shard by name (``expected``, from the manifest at ``manifest``); picklable, each
    process keeping its own answers, and sharing its hashings with the others through ``folder`` (a private
    folder, ``shared``) when it has one."""

    def __init__(self, expected: Mapping[str, str], manifest: str, folder: str | None = None) -> None:
        self.expected, self.manifest, self.folder = dict(expected), manifest, folder
        self._answers: dict[tuple, str | None] = {}  # a shard's file -> None (as written) or why not
        self._holder = None  # the process that made ``folder`` keeps it alive through this

    def __getstate__(self) -> dict:
        return {"expected": self.expected, "manifest": self.manifest, "folder": self.folder, "_answers": {},
                "_holder": None}

    def shared(self, folder: str | None = None) -> "ShardChecksums":
        """These checksums, with answers shared by every process through ``folder`` (a folder only this user
        can write: a spool's); None: a fresh one of this user's, deleted with the returned object."""
        copy = ShardChecksums(self.expected, self.manifest, folder)
        if folder is None:
            from .retry import ONCE
            from .spool import Spool

            copy._holder = Spool(None, None, ONCE)  # a private folder, swept like a spool if this process is killed
            copy.folder = copy._holder.root
        return copy

    def check(self, shard: str, fd: int) -> None:
        """OSError naming ``shard`` (a path or URL) unless the file open at ``fd`` has the manifest's sha256
        (``answer``)."""
        why = self.answer(shard, fd)
        if why is not None:
            raise OSError(why)

    def answer(self, shard: str, fd: int) -> str | None:
        """None when the file open at ``fd`` has the manifest's sha256 for ``shard``, else why not; reads the
        file through (``os.pread``: ``fd``'s position is left alone) once per machine with a ``folder``, once
        per process without."""
        name, st = shard_name(shard), os.fstat(fd)
        # a copy fetched again is checked again; ctime too, which no one sets back as `touch -r` does mtime
        key = (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in self._answers:
            self._answers[key] = self._judge(name, shard, fd, key)
        return self._answers[key]

    def hashed(self) -> collections.Counter[str]:
        """How many times each shard (by name) was hashed in ``folder``, by any process, as far back as its
        log keeps (``private.append_log``); empty without a folder."""
        return read_log(os.path.join(self.folder, HASHED_LOG)) if self.folder is not None else collections.Counter()

    def _judge(self, name: str, shard: str, fd: int, key: tuple) -> str | None:
        want = self.expected.get(name)
        if want is None:
            return (f"{redact(shard)}: not listed with a sha256 in {redact(self.manifest)}, so it cannot be verified: "
                    "write the shards again with `gpufeed shards`, or give verify_checksums=False")
        if self._digest(shard, fd, key) == want:
            return None
        return (f"{redact(shard)}: its sha256 is not the one {redact(self.manifest)} lists (the shard changed "
                "since `gpufeed shards` wrote it: bit rot, a partial copy or tampering): run the conversion's "
                "`gpufeed shards` command again to make it anew (`gpufeed shards --verify DEST` lists every "
                "changed shard), or give verify_checksums=False to read it as it is")

    def _digest(self, shard: str, fd: int, key: tuple) -> str:
        """The sha256 of the file open at ``fd``: the one a process recorded in ``folder`` for this very file
        (``key``), else hashed here under the shard's lock, and recorded."""
        if self.folder is None:
            return _sha256(fd)
        record = os.path.join(self.folder, "sha256-" + hashlib.sha256(unsigned(shard).encode()).hexdigest()[:24])
        known = _recorded(record + ".json", key)
        if known is not None:
            return known
        lock = open_file(record + ".lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be hashing it: its answer is this one's
            known = _recorded(record + ".json", key)
            if known is not None:
                return known
            digest = _sha256(fd)
            write_json(record + ".json", {"key": list(key), "sha256": digest})
            append_log(os.path.join(self.folder, HASHED_LOG), key[0])
            return digest
        finally:
            os.close(lock)  # closing the descriptor releases the lock


def _recorded(path: str, key: tuple) -> str | None:
    """The sha256 recorded at ``path`` for the file ``key`` names, or None (none, another file's, or malformed)."""
    record = read_json(path, limit=1 << 12)
    if not isinstance(record, dict) or record.get("key") != list(key):
        return None
    digest = record.get("sha256")
    return digest if isinstance(digest, str) else None


def _sha256(fd: int) -> str:
    h, pos = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, pos):
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()
