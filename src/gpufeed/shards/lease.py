"""One conversion at a time in a folder URL: a lease object beside the shards.

Object stores have no lock, so a conversion to a URL writes its holder record (``HOLDER``: host, process,
source, a random token, and the time its lease runs until) and renews it every ``RENEW_S`` while it runs.
A second conversion reads the record first and is refused while the lease runs, unless the holder is a
process of this same host that has ended (a killed conversion is resumed at once from the machine it ran
on; from another machine, once its lease has run out). Two conversions that find no live lease at the same
moment both write their record; each reads it back after ``SETTLE_S``, and only the one whose record stands
goes on (object stores read back what was last written). A conversion whose lease was taken over, or that
could not renew it in time, stops before its next shard.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ..sources.manifest import PROGRESS
from ..sources.private import process_identity, process_runs
from ..sources.urls import redact

if TYPE_CHECKING:
    from .dest import Destination

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


def holder_record(owner: dict[str, Any]) -> dict[str, Any]:
    """This process as a holder record: host, process identity (pid and start time), since when, ``owner``."""
    return {"host": socket.gethostname(), **process_identity(os.getpid()), "since": int(time.time()), **owner}


def _live(doc: Any, now: float) -> bool:
    """Whether a holder record read back still holds its destination."""
    if not isinstance(doc, dict):
        return False
    until = doc.get("until")
    if not isinstance(until, (int, float)) or isinstance(until, bool) or until < now:
        return False
    if doc.get("host") == socket.gethostname() and not process_runs(doc):
        return False  # killed on this machine: nothing holds it
    return True


class Lease:
    """A folder URL held by this process for one conversion (``take``, ``check``, ``release``)."""

    def __init__(self, dest: "Destination", owner: dict[str, Any]) -> None:
        self.dest, self.token = dest, secrets.token_hex(8)
        self.record = {**holder_record(owner), "token": self.token}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # why the lease is no longer ours

    def take(self) -> None:
        """Hold the destination, or raise ValueError naming who holds it and until when."""
        held = self.dest.read_json(HOLDER)
        if _live(held, time.time()):
            raise ValueError(self._refusal(held))
        self._write()
        time.sleep(SETTLE_S)
        back = self.dest.read_json(HOLDER)
        if not isinstance(back, dict) or back.get("token") != self.token:
            raise ValueError(self._refusal(back))
        self._thread = threading.Thread(target=self._renew, name="gpufeed-shards-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise ValueError if the lease is no longer this conversion's (before it publishes more)."""
        if self.lost is not None:
            raise ValueError(f"{redact(self.dest.root)}: this conversion no longer holds the destination "
                             f"({self.lost}); it stopped before writing more. Run the same command again once "
                             "the other conversion ended")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and _token(self.dest.read_json(HOLDER)) == self.token:
            self.dest.remove([HOLDER])

    def _write(self) -> None:
        self.record["until"] = time.time() + LEASE_S
        self.dest.write_json(HOLDER, self.record)

    def _renew(self) -> None:
        """Renew the lease every ``RENEW_S`` while it is ours; note why, once it is not."""
        while not self._stop.wait(RENEW_S):
            try:
                held = self.dest.read_json(HOLDER)
                if _token(held) != self.token:
                    self.lost = f"taken over by {describe_holder(held)}"
                    return
                self._write()
            except Exception as e:  # the store unreachable: try again until the lease runs out
                if time.time() > self.record["until"]:
                    self.lost = f"its lease ran out while the store could not be written ({type(e).__name__})"
                    return

    def _refusal(self, held: Any) -> str:
        until = held.get("until") if isinstance(held, dict) else None
        when = (f", whose lease runs until {time.strftime('%H:%M:%S %Z', time.localtime(until))} unless renewed"
                if isinstance(until, (int, float)) and not isinstance(until, bool) else "")
        return (f"{redact(self.dest.root)} is being written by another `gpufeed shards` ({describe_holder(held)}"
                f"{when}): one conversion per destination at a time; wait for it to end, or, if that process is "
                f"gone, run the same command again once its lease has run out (or delete "
                f"{redact(self.dest.where(HOLDER))})")


def _token(doc: Any) -> Any:
    return doc.get("token") if isinstance(doc, dict) else None
