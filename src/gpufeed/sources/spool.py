"""Local files made once per machine and read by every worker process: whole copies of remote files
(each fetched once, one streamed GET), or what a source makes from its files (Parquet row groups'
image bytes, ``parquet``), made ahead of need and deleted once the epoch's order has passed them.

    main process:  Readahead(order) ─► thread pool: make the next ``ahead`` items of the order
                                       delete those the order has passed
    workers:       Spool.local(name) ─► the local file (waits on the item's lock while it is being
                                        made; makes it itself if nobody has)

One process makes an item at a time: a per-item ``flock`` guards the making (waited on for as long as one
fetch may take, no longer: a lock kept by a hung or forked holder does not stop the others, which then make it
themselves), whose file lands under a random temporary name (created exclusively, never through a link) and is
renamed when complete, so a reader never sees a partial one. An item whose making failed (after its retries) leaves a marker for
``FAILED_TTL`` seconds, so the other samples of that item fail at once (each reported) rather than each
waiting out the retries again. Each making is logged in the folder (``Spool.made``), URLs redacted.

Trust: the folder is this user's alone (``private``: mode 0700, or a ``spool_dir`` that only this user can
write; anything else is refused). Each item has a JSON record beside it (``<item>.meta``: its size, the
remote object's version where the store gave one, the session that made it); an item is used only when its
size is the recorded one and its maker's session still lives (ranks sharing a ``spool_dir``), or, for a
copy left by a process that is gone, when the remote object still has that size and version (asked once);
otherwise it is made again. A default spool left by a killed process is removed by the next one made.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import queue
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from .fetch import Fetcher, FetchLimits, version_of
from .private import (LOG_BYTES, Session, append_log, create_file, lock_within, open_file, private_dir, read_json,
                      read_log, sweep_spools, user_base, with_missing_ok, write_file, write_json)
from .retry import RetryPolicy, single_attempt, single_attempt_fs, with_retries
from .urls import filesystem, scrub, unsigned

FETCH_THREADS = 4  # items (whole files, extracted row groups) made at once, per loader
FAILED_TTL = 10.0  # seconds a failed fetch is remembered (retries already waited before it was declared)
FETCH_WAIT_SPARE = 5.0  # seconds past a fetch's own deadlines that another process's making is waited for
MADE_LOG = "made.log"  # in the folder: one line per item made, by any process
MADE_LOG_BYTES = LOG_BYTES  # then it becomes made.log.1 (the one before is dropped): a kept spool_dir stays small
SPOOL_PREFIX = "spool-"  # default spools: <temporary folder>/gpufeed-<uid>/spool-<pid>-<random>
RETRIED = ".retried-"  # <folder>/.retried-<session>/<item key>: an item whose retry a process of the session said
RETRY_SAID_TTL = 600.0  # seconds after a URL's retry warning before a retry of it warns again (a later outage)

Make = Callable[[str], None]  # writes an item's whole content to the path it is given


def _key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:24]


class Spool:
    """A local folder of whole copies of remote files, or of items a source makes (picklable: workers get
    the folder's name). An item is named by a string: a URL, fetched whole unless a ``make`` is given.

    ``root`` None: a fresh folder in this user's temporary folder (``private.user_base``), deleted when
    this object (in the process that made it) is garbage-collected or the interpreter exits, or by the next
    spool made after a kill; else a folder only this user can write (made with mode 0700 if missing;
    ``PermissionError`` saying why otherwise). ``storage_options`` go to fsspec; ``retry`` governs each
    fetch, ``limits`` bounds each plain GET; ``direct``: fetch through a plain or signed HTTP GET where
    possible (``fetch.Fetcher``), else always through fsspec.
    """

    def __init__(self, root: str | None, storage_options: dict[str, Any] | None, retry: RetryPolicy,
                 direct: bool = True, limits: FetchLimits = FetchLimits()) -> None:
        self.storage_options, self.retry, self.direct, self.limits = dict(storage_options or {}), retry, direct, limits
        owned = root is None
        if owned:
            base = user_base()
            sweep_spools(base, SPOOL_PREFIX)
            root = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=base)
        else:
            root = private_dir(os.fspath(root), "spool_dir")
            Session.sweep(root)
            _sweep_retried(root)
        self.root = root
        session = Session(root)  # held by this process only: workers carry its token
        self.session = session.token
        self._init_local()
        # at garbage collection or exit: the session ends; a default spool goes with it
        weakref.finalize(self, _end, session, root if owned else None)

    def _init_local(self) -> None:
        """What each process makes for itself (none of it travels to the workers)."""
        self._fetcher = Fetcher(self.storage_options, self.direct, self.limits)
        self._fs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._live = {self.session}  # sessions seen alive from this process
        self._users: collections.Counter[str] = collections.Counter()  # main process: readaheads wanting a file
        self._queue: queue.SimpleQueue | None = None  # URLs for the fetch threads, made on the first readahead
        # main process, set by the source: an item a fetch thread made or found, open (url, descriptor, path) ...
        self.on_ready: Callable[[str, int, str], None] | None = None
        # ... and a copy about to be deleted (url, path); what they do is the source's, never the fetch's concern
        self.on_drop: Callable[[str, str], None] | None = None

    def __getstate__(self) -> dict:
        return {"storage_options": self.storage_options, "retry": self.retry, "root": self.root,
                "direct": self.direct, "limits": self.limits, "session": self.session}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()

    def path_of(self, url: str) -> str:
        """Where item ``url`` lives: named by a digest of the whole name, with the suffix of the object it
        names (never a query string's)."""
        suffix = os.path.splitext(url)[1]
        if not suffix[1:].isalnum():  # ".tar?X-Amz-Signature=...": the object's own suffix
            suffix = os.path.splitext(unsigned(url))[1]
        return os.path.join(self.root, _key(url) + (suffix if suffix[1:].isalnum() and len(suffix) <= 16 else ""))

    def filesystem(self, url: str):
        """The filesystem for ``url``'s scheme, made once per process; its calls are retried by the spool's
        ``RetryPolicy`` alone (``retry.single_attempt``)."""
        proto = url.split("://", 1)[0]
        fs = self._fs.get(proto)
        if fs is None:
            fs = self._fs[proto] = filesystem(url, single_attempt(url, self.storage_options))
            single_attempt_fs(fs)
        return fs

    def fetch(self, url: str, path: str) -> str | None:
        """Write the whole of ``url`` to ``path`` (OSError naming the URL when that fails after the retries);
        the object's version as the GET saw it (``fetch.version_of``), if it gave one."""
        filesystem = functools.partial(self.filesystem, url)  # made only if the fetch needs fsspec
        return with_retries(lambda: self._fetcher.get(filesystem, url, path), url, self.retry, "fetch the file",
                            functools.partial(self._first_retry, url))

    def _first_retry(self, url: str) -> bool:
        """Whether no process of this session (the loader's, its workers') has said a retry of ``url`` in the
        last ``RETRY_SAID_TTL`` seconds; from now on one has. A marker file, made exclusively, decides it; an
        outage later than its life is said again."""
        folder = os.path.join(self.root, RETRIED + self.session)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError:  # the marker cannot be made: said, as without one
            return True
        marker = os.path.join(folder, _key(url))
        try:
            os.close(create_file(marker))
        except FileExistsError:
            return _claim_stale(marker)
        except OSError:
            return True
        return True

    def local(self, url: str, make: Make | None = None) -> str:
        """The path of the complete item ``url``, made now if no process has (or if the one found cannot be
        trusted: module docstring): ``make(path)`` writes it (an OSError naming what failed), by default a
        fetch of the URL (``fetch``)."""
        path = self.path_of(url)
        if self._usable(url, path, make):
            return path
        lock = open_file(path + ".lock", os.O_CREAT | os.O_RDWR)
        try:
            # another process may be fetching it: wait for that, as long as a fetch may take and no longer (a
            # child forked while it held the lock keeps it); past that, made here (it lands whole by a rename)
            lock_within(lock, self._fetch_wait())
            if self._usable(url, path, make):
                return path
            for leftover in (path, path + ".meta", path + ".members"):  # untrusted, or gone: made anew
                with_missing_ok(os.unlink, leftover)
            failed = _recent_failure(path + ".failed")
            if failed is not None:
                raise OSError(failed)
            part = f"{path}.{secrets.token_hex(6)}.part"
            os.close(create_file(part))
            try:
                version = (make or functools.partial(self.fetch, url))(part)
                write_json(path + ".meta", {"size": os.stat(part).st_size, "version": version if make is None else None,
                                            "session": self.session})
                os.replace(part, path)  # complete: get_file raises on a dropped or cut-short transfer
            except OSError as e:
                write_file(path + ".failed", scrub(str(e)).encode("utf-8", "replace"))
                raise
            finally:
                with_missing_ok(os.unlink, part)
            self._log(url)
            return path
        finally:
            os.close(lock)  # closing the descriptor releases the lock

    def _fetch_wait(self) -> float:
        """Seconds one fetch may take: its retries' deadline (an hour where it has none) and one more attempt's,
        with ``FETCH_WAIT_SPARE`` to spare."""
        retries = self.retry.deadline if self.retry.deadline is not None else 3600.0
        return retries + self.limits.deadline + FETCH_WAIT_SPARE

    def _usable(self, url: str, path: str, make: Make | None) -> bool:
        """Whether the item at ``path`` is complete and may be trusted: a regular file of the size its record
        gives, made by a session that still lives, or (a fetched copy left by a process now gone) matching
        the remote object's size and version, after which the record is this session's."""
        meta = read_json(path + ".meta", limit=1 << 16)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        if not isinstance(meta, dict) or not stat.S_ISREG(info.st_mode) or meta.get("size") != info.st_size:
            return False
        session = meta.get("session")
        if isinstance(session, str) and (session in self._live or Session.alive(self.root, session)):
            self._live.add(session)
            return True
        if make is not None:  # something a source made: made again rather than checked
            return False
        remote = self._remote(url)
        if remote is None or remote.get("size") != info.st_size or (
                meta.get("version") and version_of(remote) and version_of(remote) != meta["version"]):
            return False
        write_json(path + ".meta", dict(meta, session=self.session))
        return True

    def _remote(self, url: str) -> dict | None:
        """What the store says of the object at ``url`` (size, ETag, ...), or None when it cannot say."""
        try:
            return with_retries(lambda: self.filesystem(url).info(url), url, self.retry, "look the file up",
                                functools.partial(self._first_retry, url))
        except OSError:
            return None

    def _log(self, name: str) -> None:
        append_log(os.path.join(self.root, MADE_LOG), scrub(name), MADE_LOG_BYTES)

    def made(self) -> collections.Counter[str]:
        """How many times each item was made (fetched or extracted) in this folder, by any process, as far
        back as the log keeps (about ``MADE_LOG_BYTES`` to twice that). More than once in an epoch: it was
        deleted while still wanted."""
        return read_log(os.path.join(self.root, MADE_LOG))

    def open(self, url: str, make: Make | None = None) -> tuple[int, str]:
        """A read-only descriptor of the item ``url`` (``local``), and its path (made again if the main
        process deleted it between ``local`` and the open: the order had passed it)."""
        for _ in range(2):
            path = self.local(url, make)
            try:
                return os.open(path, os.O_RDONLY | os.O_NOFOLLOW), path
            except FileNotFoundError:
                continue
        path = self.local(url, make)
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW), path

    def drop(self, url: str) -> None:
        """Delete the local copy and what readers left beside it (readers holding it open keep reading it). A
        fetch that waits on the removed lock file and one that makes it anew may both fetch; each writes its
        own part file and renames it whole, so either copy is complete."""
        path = self.path_of(url)
        if self.on_drop is not None:
            _quietly(self.on_drop, url, path)
        # the copy after its index: a reader that sees it finds its index
        for leftover in (path + ".members", path, path + ".meta", path + ".failed", path + ".lock"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass

    def readahead(self, urls: Sequence[str], of_sample: np.ndarray, ahead: int,
                  make: Callable[[int], Make] | None = None) -> "Readahead":
        """Main process: make ahead along ``of_sample`` (the item of each entry of an order): item f is
        ``urls[f]``, made by ``make(f)`` (default: fetched)."""
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                for i in range(FETCH_THREADS):  # daemons: an exit never waits for a fetch's retries
                    threading.Thread(target=_fetch_loop, args=(weakref.ref(self), self._queue), daemon=True,
                                     name=f"gpufeed-fetch-{i}").start()
        return Readahead(self, urls, of_sample, ahead, make)

    def _submit(self, url: str, make: Make | None) -> None:
        self._queue.put((url, make))

    def __del__(self) -> None:
        if getattr(self, "_queue", None) is not None:
            for _ in range(FETCH_THREADS):
                self._queue.put(None)

    def _want(self, url: str) -> None:
        with self._lock:
            self._users[url] += 1

    def _done(self, url: str) -> None:
        with self._lock:
            self._users[url] -= 1
            if self._users[url] <= 0:
                del self._users[url]
                self.drop(url)

    def drop_unless_wanted(self, url: str) -> None:
        """Delete ``url``'s local copy unless an order still wants it."""
        with self._lock:
            if url not in self._users:
                self.drop(url)

    def _fetch_quietly(self, url: str, make: Make | None) -> None:
        """Make ``url`` if an order still wants it (one closed since it was queued does not), and delete
        it if every order that wanted it closed while it was being made."""
        with self._lock:
            if url not in self._users:
                return
        try:
            path = self.local(url, make)
        except Exception:  # the worker that reads it fetches again and reports the error with the sample
            pass
        else:
            if self.on_ready is not None:
                _quietly(self._ready, url, path)
        self.drop_unless_wanted(url)

    def _ready(self, url: str, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self.on_ready(url, fd, path)
        finally:
            os.close(fd)


def _quietly(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``; a failure is the worker's to meet and report (it reads the same item), not a fetch thread's."""
    try:
        fn(*args)
    except Exception:
        pass


def _end(session: Session, root: str | None) -> None:
    session.close()
    shutil.rmtree(os.path.join(session.folder, RETRIED + session.token), True)
    if root is not None:
        shutil.rmtree(root, True)


def _sweep_retried(root: str) -> None:
    """Remove the retry markers (``RETRIED``) of sessions whose process is gone."""
    for name in os.listdir(root):
        if name.startswith(RETRIED) and not Session.alive(root, name[len(RETRIED):]):
            shutil.rmtree(os.path.join(root, name), True)


def _claim_stale(marker: str) -> bool:
    """Whether this process took the retry marker at ``marker`` (``Spool._first_retry``) because its warning
    is older than ``RETRY_SAID_TTL``: renamed away by one process only, then made anew for the next ones."""
    try:
        if time.time() - os.lstat(marker).st_mtime < RETRY_SAID_TTL:
            return False
        taken = f"{marker}.{secrets.token_hex(6)}"
        os.rename(marker, taken)  # of the processes that found it stale, only one renames it
    except OSError:  # gone: another process took it, and warned
        return False
    with_missing_ok(os.unlink, taken)
    try:
        os.close(create_file(marker))
    except OSError:  # made meanwhile by a process that warned too: said twice at most
        pass
    return True


def _recent_failure(marker: str) -> str | None:
    """The error a failed making left at ``marker`` within ``FAILED_TTL`` seconds, else None (a link there
    is no marker)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with open(fd, "rb") as f:
        if time.time() - os.fstat(f.fileno()).st_mtime >= FAILED_TTL:
            return None
        return f.read(1 << 14).decode("utf-8", "replace")


def _fetch_loop(spool_ref: weakref.ref, items: queue.SimpleQueue) -> None:
    """A fetch thread: make each (name, make) put in the queue, until None or the spool is gone."""
    while (item := items.get()) is not None:
        spool = spool_ref()
        if spool is None:
            return
        spool._fetch_quietly(*item)
        del spool, item


class Readahead:
    """One epoch order's making: the next ``ahead`` distinct items from the position submitted to the
    workers are made (or being made); an item whose last sample in the order lies before the oldest batch
    still with the workers is deleted, unless another order still wants it."""

    def __init__(self, spool: Spool, urls: Sequence[str], of_sample: np.ndarray, ahead: int,
                 make: Callable[[int], Make] | None = None) -> None:
        self.spool, self.urls, self.ahead, self.make = spool, urls, max(1, ahead), make
        self.of_sample = of_sample = np.asarray(of_sample, np.int64)
        # the files in order of first appearance, where each first and last appears
        files, first = np.unique(of_sample, return_index=True)
        order = np.argsort(first)
        self.files, self.first = files[order], first[order]
        last = len(of_sample) - 1 - np.unique(of_sample[::-1], return_index=True)[1]
        self.last = dict(zip(np.unique(of_sample).tolist(), last.tolist()))
        self.fetched = 0  # files[:fetched] were handed to the fetch threads
        self.passed: set[int] = set()
        self.closed = False

    @property
    def exhausted(self) -> bool:
        """Whether every item of the order was handed to the fetch threads."""
        return self.fetched == len(self.files)

    def at(self, submitted: int, done: int) -> None:
        """Entries ``[0, submitted)`` of the order are with the workers, ``[0, done)`` delivered."""
        if self.closed:
            return
        current = int(np.searchsorted(self.first, submitted, side="left"))  # files started by the workers
        while self.fetched < min(len(self.files), current + self.ahead):
            f = int(self.files[self.fetched])
            self.spool._want(self.urls[f])
            self.spool._submit(self.urls[f], self.make(f) if self.make is not None else None)
            self.fetched += 1
        for f in self.files[: self.fetched].tolist():
            if f not in self.passed and self.last[f] < done:
                self.passed.add(f)
                self.spool._done(self.urls[f])

    def loaded_again(self, positions: Sequence[int]) -> None:
        """Entries ``positions`` of the order were loaded once more (a batch with no good sample refilled under
        ``on_error="skip"``): an item the order had passed and deleted was made again by the workers that read
        them, and nothing else would delete it: delete it again, now that they have read it."""
        for f in sorted({int(self.of_sample[p]) for p in positions}):
            if f in self.passed:
                self.spool.drop_unless_wanted(self.urls[f])

    def close(self) -> None:
        """Stop fetching for this order; its files are released (deleted unless another order wants them)."""
        if self.closed:
            return
        self.closed = True
        for f in self.files[: self.fetched].tolist():
            if f not in self.passed:
                self.spool._done(self.urls[f])
