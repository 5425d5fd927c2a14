"""Shards checked against their manifest's sha256 as the loader reads them (``verify_checksums=True``).

A shard is hashed at most once per loader on each machine, not once per worker: the answer (the sha256 of
one file, keyed by its device, inode, size, mtime and ctime) is kept in a private folder every process of the
loader shares (the spool's, for remote shards and Parquet files; for local tar shards one of its own, shared
with the other loaders over the same source object), under a per-shard lock, so the workers that open a shard
together wait for one hashing and take its answer. A lock held past ``LOCK_WAIT`` seconds (a hung holder, a
forked child that kept it) is not waited on further: the shard is hashed without it. A folder that fails (gone,
full, out of descriptors) stops the sharing, never the check: the shard is hashed by the process reading it. A
remote shard is hashed by the loader's fetch threads as soon as its copy lands, ahead of the workers; a local
one by the first process to open it. A file changed since (a copy fetched again, a rewrite, even one with its
mtime set back) has another key and is hashed again. ``hashed()`` counts one loader's hashings
(``loader.stats["shards_hashed"]``): a read-through each, cheap beside decoding
(BENCHMARKS.md#robustness-costs). A shard whose bytes are not
the ones ``gpufeed shards`` wrote fails every sample read from it, with an error naming the shard, the
manifest and the ways out; under ``on_error="skip"`` those samples are skipped and counted like any other
bad sample.
"""

from __future__ import annotations

import collections
import hashlib
import os
import secrets
import weakref
from typing import Mapping

from .private import append_log, lock_within, open_file, read_json, read_log, write_json
from .urls import redact, unsigned

_CHUNK = 1 << 20
HASHED_LOG = "hashed.log"  # in the shared folder, <HASHED_LOG>-<token>: one line per shard hashed for a loader
SESSION_LOG_BYTES = 1 << 40  # a loader's own log is never rotated, so its count never goes down
LOCK_WAIT = 5.0  # seconds a process waits on another's hashing of a shard before hashing the shard itself
ANSWERS_KEPT = 4096  # answers each process keeps in memory, the newest


def shard_name(path: str) -> str:
    """The name a manifest lists a shard by: its file name (a URL's, without query or credentials)."""
    return os.path.basename(unsigned(path).rstrip("/"))


class ShardChecksums:
    """The sha256 of each shard by name (``expected``, from the manifest at ``manifest``); picklable, each
    process keeping its own answers, and sharing its hashings with the others through ``folder`` (a private
    folder, ``shared``) when it has one."""

    def __init__(self, expected: Mapping[str, str], manifest: str, folder: str | None = None) -> None:
        self.expected, self.manifest, self.folder = dict(expected), manifest, folder
        self.token: str | None = None  # names the log of this loader's hashings in ``folder`` (``shared``)
        # a shard's file -> None (as written) or why not; the newest ANSWERS_KEPT
        self._answers: collections.OrderedDict[tuple, str | None] = collections.OrderedDict()
        self._holder = None  # the process that made ``folder`` keeps it alive through this

    def __getstate__(self) -> dict:
        return {"expected": self.expected, "manifest": self.manifest, "folder": self.folder, "token": self.token,
                "_answers": collections.OrderedDict(), "_holder": None}

    def shared(self, folder: str | None = None, like: "ShardChecksums | None" = None) -> "ShardChecksums":
        """These checksums, with answers shared by every process through ``folder`` (a folder only this user
        can write: a spool's); None: the private folder of ``like`` (the copy another loader over the same
        source holds) while it lives, else a fresh one of this user's, deleted with the last copy holding it.
        Each copy counts its own hashings (``hashed``)."""
        copy = ShardChecksums(self.expected, self.manifest, folder)
        if folder is None:
            copy._holder = _live_holder(like) or _new_holder()
            copy.folder = copy._holder.root
        copy.token = secrets.token_hex(8)
        # the log dies with the copy that counts it: a kept spool_dir does not gather them
        weakref.finalize(copy, _unlink_quietly, copy._log())
        return copy

    def check(self, shard: str, fd: int) -> None:
        """OSError naming ``shard`` (a path or URL) unless the file open at ``fd`` has the manifest's sha256
        (``answer``)."""
        why = self.answer(shard, fd)
        if why is not None:
            raise OSError(why)

    def answer(self, shard: str, fd: int) -> str | None:
        """None when the file open at ``fd`` has the manifest's sha256 for ``shard``, else why not; reads the
        file through (``os.pread``: ``fd``'s position is left alone) once per loader on this machine with a
        ``folder``, once per process without."""
        name, st = shard_name(shard), os.fstat(fd)
        # a copy fetched again is checked again; ctime too, which no one sets back as `touch -r` does mtime
        key = (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in self._answers:
            self._answers.move_to_end(key)
        else:
            self._answers[key] = self._judge(name, shard, fd, key)
            if len(self._answers) > ANSWERS_KEPT:  # copies fetched again each epoch would grow it without end
                self._answers.popitem(last=False)
        return self._answers[key]

    def hashed(self) -> collections.Counter[str]:
        """How many times each shard (by name) was hashed for this copy (``shared``) and the workers it went
        to, in this session only; empty without a folder."""
        return read_log(self._log()) if self.folder is not None and self.token is not None else collections.Counter()

    def _log(self) -> str:
        return os.path.join(self.folder, f"{HASHED_LOG}-{self.token}")

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
        (``key``), else hashed here under the shard's lock (waited on for ``LOCK_WAIT`` seconds at most), and
        recorded. A folder that fails (gone, full, out of descriptors) only stops the sharing."""
        if self.folder is None:
            return _sha256(fd)
        record = os.path.join(self.folder, "sha256-" + hashlib.sha256(unsigned(shard).encode()).hexdigest()[:24])
        known = _recorded(record + ".json", key)
        if known is not None:
            return known
        try:
            lock = open_file(record + ".lock", os.O_CREAT | os.O_RDWR)
        except OSError:  # the shard's bytes are still here to hash: the folder's failure is no shard's
            return _sha256(fd)
        try:
            # another process may be hashing it: its answer is this one's, unless it holds the lock too long
            if lock_within(lock, LOCK_WAIT):
                known = _recorded(record + ".json", key)
                if known is not None:
                    return known
            digest = _sha256(fd)
            self._record(record + ".json", key, digest)
            return digest
        finally:
            os.close(lock)  # closing the descriptor releases the lock

    def _record(self, path: str, key: tuple, digest: str) -> None:
        """``digest`` kept for the other processes (written whole, so a reader without the lock sees all or
        nothing) and counted; a folder that refuses it loses the sharing, not the answer."""
        try:
            write_json(path, {"key": list(key), "sha256": digest})
        except OSError:
            pass
        append_log(self._log(), key[0], SESSION_LOG_BYTES)


def _live_holder(like: "ShardChecksums | None"):
    """The holder of ``like``'s private folder while that folder still exists, else None."""
    holder = getattr(like, "_holder", None)
    return holder if holder is not None and os.path.isdir(holder.root) else None


def _new_holder():
    from .retry import ONCE
    from .spool import Spool

    return Spool(None, None, ONCE)  # a private folder, swept like a spool if this process is killed


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
