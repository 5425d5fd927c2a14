"""Where shards go: a local folder or a folder URL (through fsspec), each file appearing only complete.

A local shard is written under a hidden temporary name in the folder and renamed (``os.replace``); a
shard for a URL is written to a local temporary file and uploaded with one ``put_file``, which object
stores (S3, GCS, Azure) make visible only once whole. Small JSON files (the progress records, the
manifest) are written the same way. A conversion keeps its progress in ``PROGRESS`` until it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..sources.manifest import PROGRESS
from ..sources.urls import filesystem, is_url, scheme
from .lease import HOLDER, Lease, describe_holder, holder_record

TEMP_SUFFIX = ".gpufeed-tmp"


def file_digest(f) -> tuple[int, str]:
    """(bytes, sha256) of what the open binary file ``f`` holds from where it stands."""
    h, size = hashlib.sha256(), 0
    while chunk := f.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


class Locked:
    """A local folder's hold: an ``flock``, which cannot be lost while this process lives."""

    token = None

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class Destination:
    """A folder (``root``: a path or URL); picklable, so each Ray actor opens its own filesystem."""

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if is_url(self.root) and scheme(self.root) == "file":
            object.__setattr__(self, "root", self.root[len("file://"):])
        object.__setattr__(self, "root", self.root.rstrip("/") if is_url(self.root) else os.path.abspath(self.root))

    @property
    def remote(self) -> bool:
        return is_url(self.root)

    def _fs(self):
        return filesystem(self.root, self.storage_options)

    def where(self, name: str) -> str:
        """The path or URL of ``name`` (may contain one "/", for the progress folder)."""
        return f"{self.root}/{name}" if self.remote else os.path.join(self.root, name)

    @contextlib.contextmanager
    def held(self, owner: dict[str, Any]) -> Iterator["Lease | Locked"]:
        """Hold the destination for one conversion; a second writer is refused, naming the holder (the host,
        process and ``owner`` it recorded, ``HOLDER``). A local folder is held by an exclusive ``flock`` on it
        (made if missing), released however this process ends; a folder URL by a lease object
        (``lease.Lease``). Yields the hold: its ``check()`` raises once a lease was lost, and its ``token``
        (None for a lock) is what each shard's writer finds in the record before publishing."""
        if self.remote:
            lease = Lease(self, owner)
            lease.take()
            try:
                yield lease
            finally:
                lease.release()
            return
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"{self.root} is being written by another `gpufeed shards` "
                                 f"({describe_holder(self.read_json(HOLDER))}): one conversion per destination at "
                                 f"a time; wait for it to end, or stop it and run the same command again") from None
            os.makedirs(os.path.join(self.root, PROGRESS), exist_ok=True)
            self.write_json(HOLDER, holder_record(owner))
            yield Locked()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.where(HOLDER))
            with contextlib.suppress(OSError):  # empty once the conversion ended
                os.rmdir(os.path.join(self.root, PROGRESS))
            os.close(fd)

    def prepare(self) -> None:
        if self.remote:
            self._fs().makedirs(self.root, exist_ok=True)
        else:
            os.makedirs(os.path.join(self.root, PROGRESS), exist_ok=True)

    def listing(self) -> dict[str, int]:
        """{name: bytes} of the files in the folder, the progress folder's as ``PROGRESS/name``, any other
        folder in it as ``name/``."""
        if self.remote:
            fs = self._fs()
            if not fs.exists(self.root):
                return {}
            head = fs._strip_protocol(self.root).rstrip("/") + "/"
            return {n[len(head):]: int(d.get("size") or 0) for n, d in fs.find(self.root, detail=True).items()
                    if n.startswith(head)}
        found = {}
        for sub in ("", PROGRESS):
            folder = os.path.join(self.root, sub)
            if os.path.isdir(folder):
                for e in os.scandir(folder):
                    name = os.path.join(sub, e.name) if sub else e.name
                    if e.is_file(follow_symlinks=False):
                        found[name] = e.stat().st_size
                    elif name != PROGRESS:  # a folder (an ImageFolder's class, say) is something else's
                        found[name + "/"] = 0
        return found

    def temp_path(self, name: str) -> str:
        """A new local file to write ``name`` into before ``publish``: beside it (local), or in the
        system's temporary folder (a URL)."""
        folder = self.root if not self.remote else tempfile.gettempdir()
        path = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        # created here, exclusively and not through a link; the mode as the umask makes it (not mkstemp's 0600)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o666))
        return path

    def publish(self, temp: str, name: str) -> None:
        """Move the finished local file ``temp`` to ``name``, whole or not at all."""
        if self.remote:
            try:
                self._fs().put_file(temp, self.where(name))
            finally:
                os.unlink(temp)
        else:
            os.replace(temp, self.where(name))

    def write_json(self, name: str, doc: Any) -> None:
        temp = self.temp_path(os.path.basename(name))
        try:
            with open(temp, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.write("\n")
        except BaseException:  # a full disk, say: nothing partial stays
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        self.publish(temp, name)

    def _open(self, name: str):
        """The file ``name``, open for reading in binary (FileNotFoundError when it is missing)."""
        return self._fs().open(self.where(name), "rb") if self.remote else open(self.where(name), "rb")

    def digest(self, name: str) -> tuple[int, str] | None:
        """(bytes, sha256) of the file ``name``, read through once; None when it is missing."""
        try:
            with self._open(name) as f:
                return file_digest(f)
        except FileNotFoundError:
            return None

    def read_json(self, name: str) -> Any:
        """The JSON document ``name``, or None when it is missing or not JSON. A URL's is read in one request:
        a file read in parts may change between them (the lease's record, renewed meanwhile)."""
        try:
            if self.remote:
                return json.loads(self._fs().cat_file(self.where(name)))
            with self._open(name) as f:
                return json.loads(f.read())
        except (FileNotFoundError, ValueError):  # none yet, or not JSON: none to go by
            return None

    def remove(self, names: list[str]) -> None:
        if not names:
            return
        if self.remote:
            self._fs().rm([self.where(n) for n in names])
            return
        for n in names:
            try:
                os.unlink(self.where(n))
            except FileNotFoundError:
                pass

    def remove_progress(self, names: list[str]) -> None:
        """Delete the progress records ``names`` and, when empty then, the progress folder."""
        self.remove(names)
        if not self.remote:
            try:
                os.rmdir(os.path.join(self.root, PROGRESS))
            except OSError:  # not empty, or gone
                pass
