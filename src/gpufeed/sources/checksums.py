"""Shards checked against their manifest's sha256 as the loader reads them (``verify_checksums=True``).

Each process hashes a shard the first time it opens it (the local file, or the spool's copy of a remote
one) and remembers the answer for that file (a copy fetched again, or a file changed since, is hashed again),
so a shard costs one read-through per process that reads it: cheap beside
decoding (BENCHMARKS.md#robustness-costs). A shard whose bytes are not the ones ``gpufeed shards`` wrote fails
every sample read from it, with an error naming the shard, the manifest and the ways out; under
``on_error="skip"`` those samples are skipped and counted like any other bad sample.
"""

from __future__ import annotations

import hashlib
import os
from typing import Mapping

from .urls import redact, unsigned

_CHUNK = 1 << 20


def shard_name(path: str) -> str:
    """The name a manifest lists a shard by: its file name (a URL's, without query or credentials)."""
    return os.path.basename(unsigned(path).rstrip("/"))


class ShardChecksums:
    """The sha256 of each shard by name (``expected``, from the manifest at ``manifest``); picklable, each
    process keeping its own answers."""

    def __init__(self, expected: Mapping[str, str], manifest: str) -> None:
        self.expected, self.manifest = dict(expected), manifest
        self._answers: dict[tuple, str | None] = {}  # a shard's file -> None (as written) or why not

    def __getstate__(self) -> dict:
        return {"expected": self.expected, "manifest": self.manifest, "_answers": {}}

    def check(self, shard: str, fd: int) -> None:
        """OSError naming ``shard`` (a path or URL) unless the file open at ``fd`` has the manifest's sha256;
        reads each file through once per process (``os.pread``: ``fd``'s position is left alone)."""
        name, st = shard_name(shard), os.fstat(fd)
        # a copy fetched again is checked again; ctime too, which no one sets back as `touch -r` does mtime
        key = (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in self._answers:
            self._answers[key] = self._judge(name, shard, fd)
        why = self._answers[key]
        if why is not None:
            raise OSError(why)

    def _judge(self, name: str, shard: str, fd: int) -> str | None:
        want = self.expected.get(name)
        if want is None:
            return (f"{redact(shard)}: not listed with a sha256 in {redact(self.manifest)}, so it cannot be verified: "
                    "write the shards again with `gpufeed shards`, or give verify_checksums=False")
        h, pos = hashlib.sha256(), 0
        while chunk := os.pread(fd, _CHUNK, pos):
            h.update(chunk)
            pos += len(chunk)
        if h.hexdigest() == want:
            return None
        return (f"{redact(shard)}: its sha256 is not the one {redact(self.manifest)} lists (the shard changed "
                "since `gpufeed shards` wrote it: bit rot, a partial copy or tampering): run the conversion's "
                "`gpufeed shards` command again to make it anew (`gpufeed shards --verify DEST` lists every "
                "changed shard), or give verify_checksums=False to read it as it is")
