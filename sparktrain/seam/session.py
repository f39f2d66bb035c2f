"""A rank's session with the driver: the messages of its channel numbered, acknowledged and kept
until acknowledged, so that the stream outlives any one TCP connection.

Pure and shared: the rank's link (``sparktrain.executor.link``) and the driver's server
(``sparktrain.driver.supervise.server``) each hold one :class:`Session` per rank. Every frame of a
run's channel starts with a header of two numbers, the message's sequence number and the highest
sequence number its sender has received from the other side (its acknowledgement), then the
message as ``protocol.encode`` wrote it. Messages that only matter while they are fresh (beats,
the line a rank is drawing) are sent unnumbered (sequence number 0) and never again; every other
message is numbered from 1 in each direction and kept by its sender until the other side
acknowledges it. When a connection breaks, the rank opens a new one and says ``resume``; each side
then sends again, in order, what the other has not acknowledged, and each side delivers a
numbered message once: one it has received already (sent again across the break) is passed over.
"""
from __future__ import annotations

import collections
import struct

from .protocol import ProtocolError

HEADER = struct.Struct("!QQ")
#: Seconds between reconnect attempts: the first soon, then doubling up to the last.
BACKOFF = (0.05, 0.1, 0.2, 0.4, 0.8)
#: Seconds one connection attempt may take before the next (a host cut off answers nothing).
CONNECT_SECONDS = 1.0
#: Seconds a reconnect may take where ``heartbeat_timeout`` is 0 (no silence is a failure).
UNBOUNDED_WINDOW = 60.0
#: The driver's connection to a rank that has said nothing for this long may be replaced by the
#: rank's new one; one heard from more recently is connected, and a second connection is refused.
STALE_SECONDS = 2.5


def reconnect_window(heartbeat_timeout: float) -> float:
    """How long after the driver was last heard from a rank keeps trying to reconnect."""
    return heartbeat_timeout if heartbeat_timeout > 0 else UNBOUNDED_WINDOW


def silence_limit(heartbeat_timeout: float) -> float | None:
    """Seconds without a word from the driver (which beats every second) after which a rank
    counts its connection as broken though no error said so (a flow dropped without a reset),
    and reconnects; None where ``heartbeat_timeout`` is 0."""
    return min(max(3.0, heartbeat_timeout / 2), 0.75 * heartbeat_timeout) if heartbeat_timeout > 0 else None


def split(data: bytes) -> tuple[int, int, bytes]:
    """A frame's sequence number, acknowledgement and message."""
    if len(data) < HEADER.size:
        raise ProtocolError(f"a frame of {len(data)} bytes is shorter than the channel's {HEADER.size} byte header")
    seq, ack = HEADER.unpack_from(data)
    return seq, ack, data[HEADER.size:]


class Session:
    """One side's count of a rank's stream, both ways. Not thread-safe: its owner holds a lock."""

    def __init__(self):
        #: The last number given to a message sent; the highest received in order.
        self.sent = 0
        self.received = 0
        #: Sent messages the other side has not acknowledged: ``(seq, body)``, oldest first.
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque()
        self.kept_bytes = 0

    def wrap(self, body: bytes, numbered: bool = True) -> bytes:
        """The frame for ``body``; a numbered one is kept until acknowledged."""
        seq = 0
        if numbered:
            self.sent = seq = self.sent + 1
            self._kept.append((seq, body))
            self.kept_bytes += len(body)
        return HEADER.pack(seq, self.received) + body

    def take(self, seq: int, ack: int) -> bool:
        """A frame arrived: take its acknowledgement; whether to deliver its message (False: a
        numbered message received before, sent again after a reconnect). Raises ProtocolError
        for a number that skips ahead or an acknowledgement of what was never sent."""
        self.acknowledged(ack)
        if seq == 0:
            return True
        if seq <= self.received:
            return False
        if seq != self.received + 1:
            raise ProtocolError(f"message {seq} arrived after message {self.received}: the ones between are missing")
        self.received = seq
        return True

    def acknowledged(self, ack: int) -> None:
        """The other side has every message up to ``ack``: they need not be kept."""
        if ack > self.sent:
            raise ProtocolError(f"the other side acknowledged message {ack}, but only {self.sent} were sent")
        while self._kept and self._kept[0][0] <= ack:
            self.kept_bytes -= len(self._kept.popleft()[1])

    def unacknowledged(self, ack: int) -> list[bytes]:
        """After a reconnect whose other side has every message up to ``ack``: the frames to send
        again, in order, each with the current acknowledgement."""
        self.acknowledged(ack)
        return [HEADER.pack(seq, self.received) + body for seq, body in self._kept]

    @property
    def pending(self) -> int:
        """How many numbered messages sent are not acknowledged yet."""
        return len(self._kept)
