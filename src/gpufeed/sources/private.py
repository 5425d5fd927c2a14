"""Folders and files only this user can write: where gpufeed keeps what it reads back later (the spool, the
index cache), and how it writes there.

A folder is taken only when this user owns it and nobody else may write in it (no group or world write
bit); a missing one is made with mode 0700. Files are created exclusively (``O_EXCL``), never through a
symbolic link (``O_NOFOLLOW``), under a random temporary name, and renamed into place whole, so a reader
sees a complete file or none. Nothing read back is unpickled or evaluated: indexes are JSON.

Liveness: a process that uses a folder holds an exclusive ``flock`` on a session file there for as long as it
lives (``Session``); the kernel drops it when the process dies, however it dies, so a later process can tell
what a dead one left behind (``Session.alive``). The file also names its owner (process id and start time):
a child forked by the user's code shares the lock's open file and would hold it after the owner died, so a
held lock counts only while its owner still runs.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from typing import Any

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
SESSION_PREFIX = ".session-"
_TOKEN = re.compile(r"[0-9a-f]{16}")  # secrets.token_hex(8)
YOUNG_S = 60.0  # a default spool without a session file younger than this may be one just being made
LOG_BYTES = 1 << 20  # then a log becomes <log>.1 (the one before is dropped): a kept folder stays small


def check_private(path: str, what: str) -> None:
    """Raise ``PermissionError`` saying why, unless ``path`` is a folder of this user's that no one else may
    write in (a symbolic link to one counts when the link is this user's too)."""
    try:
        link = os.lstat(path)
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    uid = os.getuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        raise PermissionError(f"{what} {path!r} is a symbolic link owned by uid {link.st_uid}, not by this user "
                              f"(uid {uid}): another user could point it anywhere")
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{what} {path!r} is not a directory")
    if info.st_uid != uid:
        raise PermissionError(f"{what} {path!r} is owned by uid {info.st_uid}, not by this user (uid {uid}): its "
                              "owner could plant files gpufeed would read; give a folder of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{what} {path!r} has mode {stat.S_IMODE(info.st_mode):04o}: group- or world-writable, "
                              "so other users could plant files gpufeed would read; use a folder only you can "
                              f"write (chmod go-w {path}, or a fresh one: gpufeed makes it with mode 0700)")


def private_dir(path: str, what: str) -> str:
    """``path``, made with mode 0700 (and its missing parents) if absent, after ``check_private``."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    check_private(path, what)
    return path


def user_base() -> str:
    """This user's folder under the system's temporary directory (``gpufeed-<uid>``, mode 0700), where
    default spools live."""
    return private_dir(os.path.join(tempfile.gettempdir(), f"gpufeed-{os.getuid()}"), "gpufeed's temporary folder")


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` as ``path``: created exclusively under a random name beside it, renamed into place."""
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, _CREATE, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with_missing_ok(os.unlink, tmp)
        raise


def create_file(path: str) -> int:
    """A new empty file at ``path`` (which must not exist, not even as a link), open for writing."""
    return os.open(path, _CREATE, 0o600)


def open_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symbolic link at ``path``: one found there (only this user could have
    put it in a private folder, by mistake) is removed and the open tried once more."""
    flags |= os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    os.unlink(path)
    return os.open(path, flags, mode)


def read_json(path: str, limit: int = 64 << 20) -> Any:
    """The JSON value in ``path`` (not followed through a link; at most ``limit`` bytes), or None when it is
    missing, a link, too large or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def write_json(path: str, value: Any) -> None:
    write_file(path, json.dumps(value, separators=(",", ":")).encode())


def append_log(log: str, line: str, limit: int = LOG_BYTES) -> None:
    """One line appended to the log at ``log`` (whole lines, whichever processes write at once); past
    ``limit`` bytes it becomes ``<log>.1``. A failure is passed over: a log is for counting and diagnosis."""
    try:
        fd = open_file(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            if os.fstat(fd).st_size > limit:
                os.replace(log, log + ".1")  # this line ends the old log; the next write starts a new one
            os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "surrogateescape"))
        finally:
            os.close(fd)
    except OSError:  # a full disk fails the next item, not this one
        pass


def read_log(log: str) -> collections.Counter[str]:
    """How many times each line is in the log at ``log`` and the one before it (``append_log``)."""
    counts: collections.Counter[str] = collections.Counter()
    for name in (log + ".1", log):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # missing, or a link: not a log gpufeed wrote
            continue
        with open(fd, encoding="utf-8", errors="surrogateescape") as f:
            counts.update(line.rstrip("\n") for line in f)
    return counts


def with_missing_ok(fn, path: str) -> None:
    try:
        fn(path)
    except FileNotFoundError:
        pass


class Session:
    """This process's hold on a private folder: a file ``.session-<token>`` there, exclusively locked while
    the process lives. ``token`` travels with pickled objects to the worker processes, which never hold it."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.token = secrets.token_hex(8)
        self.path = os.path.join(folder, SESSION_PREFIX + self.token)
        self._fd = create_file(self.path)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, json.dumps(process_identity(os.getpid())).encode())

    def close(self) -> None:
        if self._fd is not None:
            with_missing_ok(os.unlink, self.path)
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def alive(folder: str, token: object) -> bool:
        """Whether the process that took session ``token`` in ``folder`` still lives (its lock is held); False
        for anything that is not a token (a record's field is checked, never trusted)."""
        if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
            return False
        try:
            fd = os.open(os.path.join(folder, SESSION_PREFIX + token), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: by its owner, or by a child that inherited the descriptor
                return _owner_runs(os.read(fd, 256))
            return False
        finally:
            os.close(fd)

    @staticmethod
    def sweep(folder: str) -> None:
        """Remove the session files of processes that no longer exist."""
        for name in os.listdir(folder):
            if name.startswith(SESSION_PREFIX) and not Session.alive(folder, name[len(SESSION_PREFIX):]):
                with_missing_ok(os.unlink, os.path.join(folder, name))


def process_identity(pid: int) -> dict[str, Any]:
    """``pid`` and, where ``/proc`` tells it, the process's start time (clock ticks since boot): a pid alone
    may be reused by another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        return {"pid": pid, "start": int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])}
    except (OSError, ValueError, IndexError):
        return {"pid": pid}


def _owner_runs(recorded: bytes) -> bool:
    """Whether the owner a session file names still runs; True when it names none that can be checked."""
    try:
        owner = json.loads(recorded)
    except ValueError:
        return True  # written by an older gpufeed, or not yet: the lock alone decides
    return process_runs(owner)


def process_runs(owner: Any) -> bool:
    """Whether the process a record names (``process_identity`` of this machine) still runs; True when the
    record names none that can be checked (a record's fields are checked, never trusted)."""
    pid = owner.get("pid") if isinstance(owner, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
        return True
    now = process_identity(pid)
    if "start" not in now:  # no such process now (or no /proc to tell)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    return owner.get("start", now["start"]) == now["start"]


def sweep_spools(base: str, prefix: str) -> None:
    """Remove the folders ``<base>/<prefix>*`` that no living process holds a session in: default spools left
    by processes that were killed (the spool's own cleanup runs only at a normal exit)."""
    now = time.time()
    for entry in os.scandir(base):
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            tokens = [n[len(SESSION_PREFIX):] for n in os.listdir(entry.path) if n.startswith(SESSION_PREFIX)]
            young = now - entry.stat(follow_symlinks=False).st_mtime < YOUNG_S
        except OSError:
            continue
        if any(Session.alive(entry.path, t) for t in tokens) or (not tokens and young):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def lock_within(fd: int, wait: float) -> bool:
    """Whether an exclusive ``flock`` on ``fd`` was taken within ``wait`` seconds (False also where the filesystem
    has no locks). A holder can hold it for ever (a child forked while it held it keeps it), so nobody waits
    past a deadline."""
    deadline = time.monotonic() + wait
    pause = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # no locks on this filesystem: hashed here, unshared
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)  # a waiter takes the lock within 10 ms of its release
