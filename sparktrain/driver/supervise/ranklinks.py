"""The driver's end of one rank's session: the rank's connection of the moment, and what the
driver numbered and sent it that the rank has not acknowledged (``sparktrain.seam.session``).

A rank's connection may break and the rank come back on a new one (``protocol.Resume``): the
:class:`RankLink` outlives its connections, and whatever the driver tells the rank while none is
up (a stop, a request for stacks) is kept and goes, in order, with the next one.
"""
from __future__ import annotations

import socket
import threading
import time

from ...seam import protocol, session
from ...seam.channel import Channel


def send_bare(chan: Channel, msg: protocol.FromDriver) -> None:
    """Send ``msg`` unnumbered on a connection that belongs to no session (one refused), quietly."""
    try:
        chan.send_encoded(session.HEADER.pack(0, 0) + protocol.encode(msg))
    except OSError:
        pass


def end(chan: Channel) -> None:
    """End a connection whose send failed (what was sent of a frame cannot be taken back): the
    connections' loop reads the end of it, and closes it there."""
    try:
        chan.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RankLink:
    """One rank's session on the driver. Its methods are thread-safe: the connections' loop
    reads, the beat thread and the attempt send."""

    def __init__(self, rank: int, chan: Channel, token: str | None):
        self.rank = rank
        self.token = token
        self.session = session.Session()
        self._lock = threading.Lock()
        #: The connection up now; None while the rank is away.
        self.chan: Channel | None = chan
        #: When the rank was last heard from (monotonic): any frame.
        self.heard = time.monotonic()
        #: When its connection last ended without a goodbye (monotonic); None while it is up.
        self.dropped: float | None = None
        #: The rank said goodbye: its connection's end is no break.
        self.bye = False

    def send(self, body: bytes, numbered: bool = True) -> None:
        """Send ``body`` (a message ``protocol.encode`` wrote), or keep it (numbered) for the rank's
        next connection; an unnumbered one is sent only while a connection is up."""
        with self._lock:
            if self.chan is None and not numbered:
                return
            data = self.session.wrap(body, numbered)
            if self.chan is not None:
                try:
                    self.chan.send_encoded(data)
                except OSError:
                    end(self.chan)

    def take(self, chan: Channel, seq: int, ack: int) -> bool:
        """A frame came on ``chan``: whether its message is new (one on a connection replaced
        since, or received before, is not). Raises ProtocolError as ``Session.take`` does."""
        with self._lock:
            if chan is not self.chan:
                return False
            self.heard = time.monotonic()
            return self.session.take(seq, ack)

    def stale(self, now: float) -> bool:
        """Whether a new connection may replace the one up: none is, or the rank (which beats every
        second) has said nothing on it for ``session.STALE_SECONDS``."""
        return self.chan is None or now - self.heard > session.STALE_SECONDS

    def away_since(self) -> float:
        """When the rank was last heard from or its connection ended, whichever came first."""
        return self.heard if self.dropped is None else min(self.heard, self.dropped)

    def attach(self, chan: Channel, ack: int, reply: protocol.FromDriver | None) -> Channel | None:
        """Carry the session on ``chan``, whose rank has every message up to ``ack``: ``reply``
        first (when given), then what it lacks, in order. Returns the connection it replaces."""
        with self._lock:
            frames = self.session.unacknowledged(ack)
            if reply is not None:
                chan.send_encoded(self.session.wrap(protocol.encode(reply), numbered=False))
            for frame in frames:
                chan.send_encoded(frame)
            old, self.chan = self.chan, chan
            self.heard, self.dropped = time.monotonic(), None
            return old

    def detach(self, chan: Channel) -> bool:
        """``chan`` ended; whether it was the rank's connection up (not one replaced since)."""
        with self._lock:
            if chan is not self.chan:
                return False
            self.chan = None
            if not self.bye:
                self.dropped = time.monotonic()
            return True

    @property
    def connected(self) -> bool:
        chan = self.chan
        return chan is not None and not chan.closed

