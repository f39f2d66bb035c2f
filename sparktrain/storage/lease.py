"""A run's lease: one small object in the run's home that says which driver trains the run now.

A driver takes the lease before it launches anything (:meth:`Lease.acquire`), renews it while the
run lives (:meth:`Lease.keep`, a daemon thread that stops with the run) and releases it at the
end. Every write is conditional (``sparktrain.storage.conditional``): the lease is created only
where none is, and replaced only if it is still the version read, so of two drivers that race for
one run, one wins. A live lease of another driver is refused at once, naming its holder; a lease
whose expiry has passed (its driver died without releasing it) is taken over.

Expiry is a wall-clock time written by the holder; drivers whose clocks differ by more than a few
seconds shorten or lengthen each other's leases by that much.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ..errors import RunInUseError
from . import conditional
from .backends import StorageOptions

log = logging.getLogger("sparktrain")

FORMAT = "sparktrain-lease/1"


def when(seconds: float | None) -> str:
    """A time as the lease and ``sparktrain runs`` show it: UTC, to the second."""
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def parse(data: bytes | None) -> dict | None:
    """A lease record, or None where there is none or it is not one."""
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def live(record: dict | None, now: float | None = None) -> bool:
    """Whether ``record`` holds the run now: not released, and not past its expiry."""
    now = time.time() if now is None else now
    return bool(record) and not record.get("released") and float(record.get("expires", 0)) > now


def holder(record: dict) -> str:
    """Who holds a lease, in words: ``host h, pid 123, started 2026-11-28 10:00:00Z``."""
    return (f"host {record.get('host')}, pid {record.get('pid')}, started {when(record.get('started'))}, "
            f"lease expires {when(record.get('expires'))} unless renewed")


class Lease:
    """This driver's lease on the run whose lease object is ``url``, expiring ``seconds`` after
    each renewal."""

    def __init__(self, url: str, seconds: float, storage_options: StorageOptions = None,
                 clock: Callable[[], float] = time.time):
        self.url, self.seconds, self.options, self.clock = url, float(seconds), storage_options, clock
        self.token = uuid.uuid4().hex
        self.started = clock()
        self.version: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    def record(self, released: bool = False) -> dict:
        now = self.clock()
        return {"format": FORMAT, "host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
                "token": self.token, "renewed": now, "expires": now if released else now + self.seconds,
                "seconds": self.seconds, "released": released}

    def _write(self, current) -> bool:
        data = json.dumps(self.record()).encode()
        if current is None:
            if conditional.create(self.url, data, self.options):
                self.version = self._version_of(data)
                return self.version is not None
            return False
        if conditional.replace(self.url, data, current[1], self.options):
            self.version = self._version_of(data)
            return self.version is not None
        return False

    def _version_of(self, data: bytes):
        """The version of what this driver just wrote; None if another write came in between."""
        now = conditional.read(self.url, self.options)
        return now[1] if now is not None and now[0] == data else None

    def acquire(self, what: str) -> None:
        """Take the lease, or raise :class:`RunInUseError` naming the live holder. ``what`` names
        the run in messages."""
        for _ in range(3):  # lost races with a taker are answered by what it wrote
            current = conditional.read(self.url, self.options)
            record = parse(current[0]) if current is not None else None
            if live(record, self.clock()) and record.get("token") != self.token:
                raise RunInUseError(
                    f"{what} is being trained by another driver now ({holder(record)}). Wait for it to end, or "
                    f"give this job another run_id; a driver that died leaves a lease that expires on its own",
                    holder={k: record.get(k) for k in ("host", "pid", "started", "expires")})
            if record is not None and not record.get("released"):
                log.warning("sparktrain: %s: the lease of its last driver (%s) expired; this driver takes it over",
                            what, holder(record))
            if self._write(current):
                return
        raise RunInUseError(f"{what}: other drivers keep taking its lease ({self.url}); try again later")

    def renew(self) -> bool:
        """Extend the lease from now; False (and :attr:`lost` says why) if it is no longer ours."""
        current = conditional.read(self.url, self.options)
        record = parse(current[0]) if current is not None else None
        if record is None or record.get("token") != self.token or current[1] != self.version:
            self.lost = f"another driver holds it now ({holder(record)})" if record else "it was removed"
            return False
        return self._write(current)

    def release(self) -> None:
        """Mark the lease released, if it is still ours, so the next driver need not wait for its expiry."""
        self.stop()
        current = conditional.read(self.url, self.options)
        record = parse(current[0]) if current is not None else None
        if record is not None and record.get("token") == self.token:
            conditional.replace(self.url, json.dumps(self.record(released=True)).encode(), current[1], self.options)

    def keep(self, what: str, on_lost: Callable[[str], None] = lambda why: None) -> "Lease":
        """Renew the lease every third of its time, in a daemon thread, until :meth:`stop`; a lease
        found lost calls ``on_lost`` with why (the run stops: one driver at a time).
        A run's driver has no loop of its own between attempts (``run_elastic`` may wait minutes
        for slots), so the lease has this one thread."""
        interval = self.seconds / 3

        def renew_until_stopped():
            while not self._stop.wait(interval):
                try:
                    if not self.renew():
                        log.error("sparktrain: %s: this driver lost its lease (%s); stopping its run", what,
                                  self.lost)
                        on_lost(f"{what}: this driver lost the run's lease ({self.lost}); one driver trains a "
                                "run at a time")
                        return
                except Exception as e:  # noqa: BLE001 - a store that fails now may answer at the next renewal
                    log.warning("sparktrain: %s: renewing the lease failed (%s); trying again in %.0f s", what,
                                type(e).__name__, interval)

        self._thread = threading.Thread(target=renew_until_stopped, name="sparktrain-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
