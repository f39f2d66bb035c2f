"""The driver's connections to its ranks, on one thread: accept, greet, authenticate, read.

One ``selectors`` loop serves every rank of a run, whatever their number: a thread per connection
was a thousand threads at a thousand ranks, each woken for each of its messages. The loop accepts a
connection, greets it (``channel.greet``), reads the rank's nonce and then its frames as they come,
without blocking on any one peer: a peer that has not said hello within ``channel.AUTH_TIMEOUT``
is dropped. Whole messages go to the :class:`Handler`, on the loop's thread, in the order each rank
sent them, with their frame's sequence number and acknowledgement (``sparktrain.seam.session``): a
connection's first message is a hello, or a resume that carries a broken connection's session on.
Sending is not done here: a rank's session (``ranklinks``) sends on its connection from any thread
(the loop's own included, for the rendezvous's answer).
"""
from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from typing import Protocol

from ...seam import channel, protocol, session
from ...seam.channel import AuthenticationError, Channel

log = logging.getLogger("sparktrain")

#: Most bytes read from one connection at a time.
READ_BYTES = 256 * 1024
#: Seconds a send to one rank may wait for room before its connection counts as broken.
SEND_TIMEOUT = 30.0


class Handler(Protocol):
    """What the loop tells: its callbacks run on the loop's thread."""

    def hello(self, chan: Channel, msg: protocol.CheckedIn, seq: int, ack: int) -> bool:
        """A connection said hello; False: it is refused (the handler told it why), close it."""

    def resume(self, chan: Channel, msg: protocol.Resume, ack: int) -> str | None:
        """A connection resumes a rank's session; a reason: it is refused, close it."""

    def message(self, rank: int, chan: Channel, msg: protocol.FromRank, seq: int, ack: int) -> None:
        """A message from ``rank`` on ``chan``, after its hello."""

    def closed(self, rank: int | None, chan: Channel | None) -> None:
        """A connection ended (``rank`` None: it never said hello or resumed)."""

    def refused(self, peer: str, reason: str) -> None:
        """A connection did not prove it holds the run's secret."""

    def dropped(self, rank: int, reason: str) -> None:
        """A rank's connection sent what the protocol does not allow, and was dropped."""


class _Conn:
    def __init__(self, sock: socket.socket, peer: str, nonce: bytes, deadline: float):
        self.sock = sock
        self.peer = peer
        self.nonce = nonce
        self.deadline = deadline
        self.buf = bytearray()
        self.chan: Channel | None = None
        self.rank: int | None = None


class Connections:
    """Accepts on ``listener`` and reads every connection on one thread, until :meth:`close`."""

    def __init__(self, listener: socket.socket, secret: bytes, encrypted: bool, handler: Handler):
        self._listener = listener
        self._secret = secret
        self._encrypted = encrypted
        self._handler = handler
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        #: Connections that have not said hello yet, oldest first (their deadlines in that order).
        self._unproven: collections.deque[_Conn] = collections.deque()
        self._conns: set[_Conn] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="sparktrain-channel", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop:
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        return
                    else:
                        try:
                            self._read(key.data)
                        except Exception:  # noqa: BLE001 - one connection's trouble must not end the loop
                            log.exception("sparktrain: dropped a rank's connection")
                            self._close(key.data)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns):
                self._close(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the listener closed
            try:
                sock.settimeout(SEND_TIMEOUT)  # reads come when the loop sees data; sends wait this long
                nonce = channel.greet(sock, self._encrypted)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, peer[0], nonce, time.monotonic() + channel.AUTH_TIMEOUT)
            self._conns.add(conn)
            self._unproven.append(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.buf += data
        try:
            if conn.chan is None:
                if len(conn.buf) < channel.NONCE_BYTES:
                    return
                nonce_c = bytes(conn.buf[:channel.NONCE_BYTES])
                del conn.buf[:channel.NONCE_BYTES]
                conn.chan = channel.accepted(conn.sock, self._secret, self._encrypted, conn.nonce, nonce_c)
            while conn.sock.fileno() >= 0:
                body = conn.chan.unframe(conn.buf)
                if body is None:
                    return
                seq, ack, payload = session.split(body)
                msg = conn.chan.decode(payload)
                if conn.rank is None:
                    if not self._first(conn, msg, seq, ack):
                        return
                else:
                    self._handler.message(conn.rank, conn.chan, msg, seq, ack)
        except (AuthenticationError, ValueError) as e:  # ValueError: a ProtocolError
            if conn.rank is None:
                self._handler.refused(conn.peer, str(e))
            else:
                self._handler.dropped(conn.rank, str(e))
            self._close(conn)

    def _first(self, conn: _Conn, msg: protocol.FromRank, seq: int, ack: int) -> bool:
        """A connection's first message: a hello, or a resume; False: it was refused and closed."""
        if isinstance(msg, protocol.CheckedIn):
            conn.rank = msg.rank
            if self._handler.hello(conn.chan, msg, seq, ack):
                return True
        elif isinstance(msg, protocol.Resume):
            why = self._handler.resume(conn.chan, msg, ack)
            if why is None:
                conn.rank = msg.rank
                return True
            self._handler.refused(conn.peer, why)
        else:
            raise AuthenticationError("the first message was not a hello")
        conn.rank = None  # not the rank it claimed: it never counted as one
        self._close(conn)
        return False

    def _expire(self, now: float) -> None:
        """Drop connections that did not say hello in time (the oldest are first in line)."""
        while self._unproven and (self._unproven[0].rank is not None or conn_gone(self._unproven[0])
                                  or self._unproven[0].deadline <= now):
            conn = self._unproven.popleft()
            if conn.rank is None and not conn_gone(conn):
                self._handler.refused(conn.peer, "timed out")
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if conn.chan is not None:
            conn.chan.close()
        else:
            conn.sock.close()
        self._handler.closed(conn.rank, conn.chan)

    def close(self) -> None:
        """Stop accepting and reading; close every connection (each counts as closed)."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


def conn_gone(conn: _Conn) -> bool:
    return conn.sock.fileno() < 0
