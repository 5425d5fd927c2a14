"""One conversion at a time in a folder URL: a lease object beside the shards.

Object stores have no lock, so a conversion to a URL writes its holder record (``HOLDER``: host, process,
source, a random token, and the time its lease runs until) and renews it every ``RENEW_S`` while it runs.
A second conversion reads the record first and is refused while the lease runs, unless the holder is a
process of this same machine (same host name, boot and process namespace) that has ended: a killed
conversion is resumed at once from where it ran, and from elsewhere once its lease has run out. That reading
compares the holder's clock with the reader's: the machines' clocks are taken to agree within a minute. Two
conversions that find no live lease at the same moment both write their record; each reads it back after
``SETTLE_S``, and only the one whose record stands goes on (object stores read back what was last written).

The holder counts its lease on its own clock from the start of its last renewal that succeeded: once that
runs out (renewals failing or hanging), or once another record stands, it publishes nothing more. Every shard
is published only after its writer read the record and found this conversion's token (one read a shard,
whichever process or Ray actor writes it).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

from ..sources.manifest import PROGRESS
from ..sources.private import process_identity, process_runs
from ..sources.urls import redact


class Store(Protocol):
    """What a lease needs of its destination (``dest.Destination``)."""

    root: str

    def where(self, name: str) -> str: ...
    def read_json(self, name: str) -> Any: ...
    def write_json(self, name: str, doc: Any) -> None: ...
    def remove(self, names: list[str]) -> None: ...

HOLDER = f"{PROGRESS}/holder.json"  # who holds the destination now
# Long enough that a renewal delayed by a slow store or a busy host never lets the lease run out; short
# enough that a conversion killed on another machine can be resumed within minutes.
LEASE_S = 120.0
RENEW_S = LEASE_S / 4
SETTLE_S = 2.0  # between writing the record and reading it back: longer than two writers' requests apart


def describe_holder(doc: Any) -> str:
    """The holder record as words; the record is read back, so each field is checked."""
    if not isinstance(doc, dict):
        return "which did not say who it is"
    pid, host, source = doc.get("pid"), doc.get("host"), doc.get("source")
    said = [f"process {pid}" if isinstance(pid, int) else None, f"on {host}" if isinstance(host, str) else None,
            f"converting {source!r}" if isinstance(source, str) else None]
    return " ".join(p for p in said if p) or "which did not say who it is"


def this_machine() -> dict[str, Any]:
    """What tells this machine and process namespace from another with the same host name (containers on
    the host's network, cloned machines): the boot's id and the process namespace."""
    out: dict[str, Any] = {"host": socket.gethostname()}
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot"] = f.read().strip()
    with contextlib.suppress(OSError):
        out["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    return out


def holder_record(owner: dict[str, Any]) -> dict[str, Any]:
    """This process as a holder record: its machine, process identity (pid and start time), since when,
    ``owner``."""
    return {**this_machine(), **process_identity(os.getpid()), "since": int(time.time()), **owner}


def _until(doc: Any, now: float) -> float | None:
    """The time a record's lease runs until, where it is a time a lease can have (a finite number, at most a
    few leases ahead); None otherwise."""
    until = doc.get("until") if isinstance(doc, dict) else None
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until):
        return None
    return until if until <= now + 4 * LEASE_S else None


def _live(doc: Any, now: float) -> bool:
    """Whether a holder record read back still holds its destination."""
    until = _until(doc, now)
    if until is None or until < now:
        return False
    here = this_machine()
    if all(doc.get(k) == v for k, v in here.items()) and len(here) == 3 and not process_runs(doc):
        return False  # killed on this machine: nothing holds it
    return True


def _token(doc: Any) -> Any:
    return doc.get("token") if isinstance(doc, dict) else None


def ensure_held(dest: Store, token: str) -> None:
    """Raise ValueError unless ``dest``'s holder record is the one with ``token`` (before a shard is published,
    in whichever process writes it)."""
    held = dest.read_json(HOLDER)
    if _token(held) != token:
        raise ValueError(lost_message(dest, f"taken over by {describe_holder(held)}"))


def lost_message(dest: Store, why: str) -> str:
    return (f"{redact(dest.root)}: this conversion no longer holds the destination ({why}); it stopped before "
            "writing more. Run the same command again once the other conversion ended")


class Lease:
    """A folder URL held by this process for one conversion (``take``, ``check``, ``release``)."""

    def __init__(self, dest: Store, owner: dict[str, Any]) -> None:
        self.dest, self.token = dest, secrets.token_hex(8)
        self.record = {**holder_record(owner), "token": self.token}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._expires = 0.0  # on this process's monotonic clock: when the lease runs out unless renewed
        self.lost: str | None = None  # why the lease is no longer ours, as the renewal found

    def take(self) -> None:
        """Hold the destination, or raise ValueError naming who holds it and until when."""
        held = self.dest.read_json(HOLDER)
        if _live(held, time.time()):
            raise ValueError(self._refusal(held))
        try:
            self._write()
            time.sleep(SETTLE_S)
            back = self.dest.read_json(HOLDER)
        except BaseException:  # interrupted while taking it: leave no record of ours for others to wait on
            self._remove_ours()
            raise
        if _token(back) != self.token:
            raise ValueError(self._refusal(back))
        self._thread = threading.Thread(target=self._renew, name="gpufeed-shards-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise ValueError once the lease is not this conversion's: another record stands, or the lease ran
        out on this process's own clock (renewals failing or hanging), a renewal's time before it would."""
        if self.lost is not None:
            raise ValueError(lost_message(self.dest, self.lost))
        if time.monotonic() > self._expires - RENEW_S:
            raise ValueError(lost_message(self.dest, "its lease could not be renewed in time"))

    def release(self) -> None:
        """Stop renewing and remove the record if it is still this conversion's; a store error here is not
        raised over the conversion's own outcome (the record then runs out by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RENEW_S)
        if self.lost is None:
            self._remove_ours()

    def _remove_ours(self) -> None:
        with contextlib.suppress(Exception):
            if _token(self.dest.read_json(HOLDER)) == self.token:
                self.dest.remove([HOLDER])

    def _write(self) -> None:
        started = time.monotonic()
        record = {**self.record, "until": time.time() + LEASE_S}
        self.dest.write_json(HOLDER, record)
        self.record, self._expires = record, started + LEASE_S

    def _renew(self) -> None:
        """Renew the lease every ``RENEW_S`` while it is ours; note why, once another record stands."""
        while not self._stop.wait(RENEW_S):
            try:
                held = self.dest.read_json(HOLDER)
                if _token(held) != self.token:
                    self.lost = f"taken over by {describe_holder(held)}"
                    return
                self._write()
            except Exception:  # the store unreachable: try again; ``check`` counts the lease running out
                continue

    def _refusal(self, held: Any) -> str:
        until = _until(held, time.time())
        when = (f", whose lease runs until {time.strftime('%H:%M:%S %Z', time.localtime(until))} unless renewed"
                if until is not None else "")
        return (f"{redact(self.dest.root)} is being written by another `gpufeed shards` ({describe_holder(held)}"
                f"{when}): one conversion per destination at a time; wait for it to end, or, if that process is "
                f"gone, run the same command again once its lease has run out (or delete "
                f"{redact(self.dest.where(HOLDER))})")
