"""One shard made from its prepared samples: written, published whole, and recorded, by whichever engine
prepared them (the local engine's processes, or one Ray actor).

    prepared samples (in the plan's order) ─► ShardWriter (a local temporary file) ─► sha256, size
        ─► progress record PROGRESS/<name>.json ─► Destination.publish (rename / upload)
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from ..sources.manifest import PROGRESS
from .dest import Destination, file_digest
from .lease import ensure_held
from .plan import Plan
from .prepare import Broken, Prepared
from .writers import create_writer


class DestinationFull(OSError):
    """The destination's file system refused a write for want of room (no space, a quota, a file size
    limit); the message names the destination and the way out."""

    def __str__(self) -> str:
        return str(self.strerror)


FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class BrokenInput(ValueError):
    """An input that cannot be delivered, under ``on_error="raise"``; ``path`` names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot convert {path!r}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):  # Ray and multiprocessing rebuild it from its arguments
        return BrokenInput, (self.path, self.reason)


@dataclass(frozen=True)
class ShardRecord:
    """What was written for shard ``index``: ``samples`` of its ``inputs`` (0: no file), and why the others
    were left out (path, reason)."""

    index: int
    name: str
    size: int
    sha256: str
    samples: int
    inputs: int
    resized: int
    labels: dict[str, int]
    row_groups: list[int]
    broken: list[list[str]] = field(default_factory=list)

    def to_json(self, fingerprint: str) -> dict[str, Any]:
        return {"fingerprint": fingerprint, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "ShardRecord":
        fields = {k: doc[k] for k in cls.__dataclass_fields__}
        return cls(**fields)


@dataclass(frozen=True)
class ShardJob:
    """Everything a process needs to make any shard of the plan (picklable)."""

    plan: Plan
    dest: Destination
    classes: tuple[str, ...]
    base: str | None  # the source's folder or URL: the Parquet ``path`` of a sample is relative to it
    on_error: str
    holder: str | None = None  # a folder URL's lease token: found in the holder record before each publish

    def record_name(self, k: int) -> str:
        return f"{PROGRESS}/{self.plan.names[k]}.json"


def write_shard(job: ShardJob, k: int, samples: Iterator[Prepared | Broken]) -> ShardRecord:
    """Shard ``k`` of the plan from ``samples``, which yields its inputs' records in the plan's order;
    BrokenInput at the first that cannot be delivered under ``on_error="raise"`` (nothing written)."""
    plan, name = job.plan, job.plan.names[k]
    temp = job.dest.temp_path(name)
    writer = create_writer(plan.options["format"], temp, job.classes)
    broken, labels, resized, count = [], collections.Counter(), 0, 0
    try:
        for position in plan.positions(k):
            s = next(samples)
            if s.position != position:
                raise RuntimeError(f"shard {name}: got input {s.position} where input {position} belongs")
            if isinstance(s, Broken):
                if job.on_error == "raise":
                    raise BrokenInput(s.path, s.reason)
                broken.append([s.path, s.reason])
                continue
            writer.add(plan.key(position), s.ext, s.data, s.label, _relative(s.path, job.base))
            labels[str(s.label)] += 1
            resized += s.resized
            count += 1
        writer.close()
    except BaseException:
        with contextlib.suppress(Exception):  # on a full disk closing the file fails too: the temp goes anyway
            writer.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    size, digest = _size_and_digest(temp) if count else (0, "")
    record = ShardRecord(k, name, size, digest, count, len(plan.positions(k)), resized,
                         dict(sorted(labels.items(), key=lambda kv: int(kv[0]))), list(writer.row_groups), broken)
    if job.holder is not None:  # whichever process writes it: only while the conversion holds the destination
        try:
            ensure_held(job.dest, job.holder)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
    # the record first: a shard that is there always has one, so a resumed conversion never writes it again
    job.dest.write_json(job.record_name(k), record.to_json(plan.fingerprint))
    if count:
        job.dest.publish(temp, name)
    else:  # every input broken: no shard (the loader refuses empty ones)
        os.unlink(temp)
    return record


def _size_and_digest(path: str) -> tuple[int, str]:
    with open(path, "rb") as f:
        return file_digest(f)


def _relative(path: str, base: str | None) -> str:
    if base and path.startswith(base.rstrip("/") + "/"):
        return path[len(base.rstrip("/")) + 1:]
    return path
