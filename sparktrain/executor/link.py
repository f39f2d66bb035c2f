"""The rank's end of its channel to the driver, across connections.

One :class:`Link` per rank: it numbers and keeps what the task sends (``sparktrain.seam.session``),
and when a connection breaks (a reset, an error, or no word from the driver, who beats every
second, for ``session.silence_limit``) it reconnects on a thread of its own while the task goes
on: a new connection with the run's secret and a fresh handshake, encrypted when the run is, whose
first message names the rank, the attempt and the session (``protocol.Resume``), then everything
the driver has not acknowledged, in order. Attempts follow ``session.BACKOFF`` until the driver
has been silent for ``heartbeat_timeout`` (``session.reconnect_window``); then the link gives up,
and what the task sends goes to the executor's log instead (the task stops its rank the same
moment, as a rank cut off from the driver does).

What the task sends while no connection is up is kept and goes with the next one; past
:data:`MAX_KEPT` bytes not yet acknowledged, :meth:`Link.backlogged` tells the task to stop
reading its rank's output (the rank then waits on its pipes) until the driver catches up.
"""
from __future__ import annotations

import select
import sys
import threading
import time

from ..seam import channel, protocol, session
from ..seam.spec import TaskSpec

#: Seconds a send may wait for room before the connection counts as broken.
SEND_SECONDS = 30.0
#: Bytes of messages sent and not yet acknowledged past which the task stops reading its rank's output.
MAX_KEPT = 64 << 20


class Link:
    """The rank's channel to the driver (see the module's doc). ``send`` is thread-safe; one
    thread reads (:meth:`receive`)."""

    def __init__(self, spec: TaskSpec, rank: int, token: str):
        self.spec, self.rank, self.token = spec, rank, token
        self.session = session.Session()
        self._cond = threading.Condition()
        self.chan: channel.Channel | None = None
        #: When the driver was last heard from (monotonic).
        self.heard = time.monotonic()
        #: Given up: no connection for good.
        self.gone = False
        #: When the connection broke (monotonic), while it is down.
        self.broke_at: float | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def open(self, timeout: float) -> None:
        """The first connection (the rank's hello goes next); raises OSError where there is none."""
        chan = channel.connect(self.spec.driver_address, self.spec.secret, timeout=timeout,
                               encrypted=self.spec.encrypted)
        chan.sock.settimeout(SEND_SECONDS)
        self.chan, self.heard = chan, time.monotonic()

    @property
    def sock(self):
        chan = self.chan
        return None if chan is None else chan.sock

    # -- sending ---------------------------------------------------------------------------------
    def send(self, msg: protocol.FromRank, numbered: bool = True) -> bool:
        """Send ``msg``, or keep it (numbered) for the next connection; False once the link gave
        up, or for a message too large for a frame."""
        body = protocol.encode(msg)
        if len(body) + session.HEADER.size > channel.MAX_FRAME:
            return False
        with self._cond:
            if self.gone:
                return False
            data = self.session.wrap(body, numbered)
            chan = self.chan
            if chan is not None:
                try:
                    chan.send_encoded(data)
                except OSError as e:
                    self._broken(chan, f"a send failed: {e}")
        return True

    def backlogged(self) -> bool:
        """Whether the task should stop reading its rank's output until the driver catches up."""
        return not self.gone and self.session.kept_bytes > MAX_KEPT

    # -- receiving -------------------------------------------------------------------------------
    def receive(self, sock) -> protocol.FromDriver | None:
        """The driver's next message, read when ``sock`` is readable; None for a frame that carried
        nothing new (a resent message, or none: the connection broke, and the link reconnects), or
        where ``sock`` is no longer the connection's."""
        chan = self.chan
        if chan is None or chan.sock is not sock:
            return None
        try:
            body = chan.recv_body()
            if body is None:
                raise ConnectionError("the driver closed the connection")
            seq, ack, payload = session.split(body)
            msg = chan.decode(payload)
            with self._cond:
                fresh = self.session.take(seq, ack)
                self._cond.notify_all()  # settle() looks at what is acknowledged
        except (OSError, channel.AuthenticationError, protocol.ProtocolError) as e:
            self._broken(chan, str(e) or type(e).__name__)
            return None
        self.heard = time.monotonic()
        return msg if fresh else None

    def next_message(self, deadline: float) -> protocol.FromDriver | None:
        """Wait for the driver's next message (reconnecting as needed) until ``deadline``
        (monotonic); None at the deadline or once the link gave up."""
        while time.monotonic() < deadline and not self.gone:
            self.check_silence(time.monotonic())
            sock = self.wait_connected(deadline)
            if sock is None:
                continue
            if select.select([sock], [], [], max(0.0, min(1.0, deadline - time.monotonic())))[0]:
                msg = self.receive(sock)
                if msg is not None:
                    return msg
        return None

    def wait_connected(self, deadline: float):
        """The socket of the connection up, waiting for a reconnect until ``deadline``; None if none."""
        with self._cond:
            self._cond.wait_for(lambda: self.chan is not None or self.gone,
                                timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            return None if self.chan is None else self.chan.sock

    def check_silence(self, now: float) -> None:
        """Count the connection as broken when the driver, who beats every second, has been silent too long."""
        limit = session.silence_limit(self.spec.heartbeat_timeout)
        chan = self.chan
        if chan is not None and limit is not None and now - self.heard > limit:
            self._broken(chan, f"no word from the driver for {now - self.heard:.1f} s")

    # -- the end ---------------------------------------------------------------------------------
    def settle(self, seconds: float) -> bool:
        """Wait until the driver has every numbered message sent (reading what it sends meanwhile,
        reconnecting as needed), up to ``seconds`` and while the link has not given up."""
        deadline = time.monotonic() + seconds
        while True:
            with self._cond:
                if self.session.pending == 0:
                    return True
                if self.gone or time.monotonic() >= deadline:
                    return False
            self.next_message(min(deadline, time.monotonic() + 0.5))

    def close(self, seconds: float) -> None:
        """Say goodbye (waiting up to ``seconds`` for the driver to have everything), stop
        reconnecting, and close."""
        if self.chan is not None or self._thread is not None:
            if self.send(protocol.Bye()):
                self.settle(seconds)
        self._closing.set()
        thread = self._thread
        if thread is not None:
            thread.join(session.CONNECT_SECONDS + 1.0)
        with self._cond:
            chan, self.chan, self.gone = self.chan, None, True
        if chan is not None:
            chan.close()

    # -- reconnecting ----------------------------------------------------------------------------
    def _broken(self, chan: channel.Channel, why: str) -> None:
        """``chan`` broke: drop it and reconnect (once per break: a later report of it is stale)."""
        with self._cond:
            if chan is not self.chan or self._closing.is_set():
                return
            self.chan, self.broke_at = None, time.monotonic()
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._reconnect, name=f"sparktrain-link-{self.rank}",
                                                daemon=True)
        chan.close()
        if start:
            _say(f"sparktrain rank {self.rank}: the channel to the driver broke ({why}); reconnecting")
            self._thread.start()

    def _reconnect(self) -> None:
        tries = 0
        window = session.reconnect_window(self.spec.heartbeat_timeout)
        while not self._closing.is_set():
            left = self.heard + window - time.monotonic()
            if left <= 0:
                break
            try:
                if self._resume(min(session.CONNECT_SECONDS, left)):
                    return
            except (OSError, channel.AuthenticationError, protocol.ProtocolError):
                pass
            self._closing.wait(session.BACKOFF[min(tries, len(session.BACKOFF) - 1)])
            tries += 1
        with self._cond:
            self._thread = None
            if not self._closing.is_set() and self.chan is None:
                self.gone = True
            self._cond.notify_all()
        if self.gone and not self._closing.is_set():
            _say(f"sparktrain rank {self.rank}: could not reconnect to the driver within {window:g} s; output now "
                 "goes to this executor's log")

    def _resume(self, timeout: float) -> bool:
        """One attempt: connect, hand over the session, send what the driver may lack."""
        chan = channel.connect(self.spec.driver_address, self.spec.secret, timeout=timeout,
                               encrypted=self.spec.encrypted)
        try:
            with self._cond:
                hello_kept = self.session.sent >= 1 and self.session.pending == self.session.sent
            if not hello_kept:  # the driver has the hello: name the session, and wait for its word
                with self._cond:
                    first = self.session.wrap(protocol.encode(protocol.Resume(
                        self.rank, self.spec.attempt, self.token, time.monotonic() - self.heard)), numbered=False)
                chan.send_encoded(first)
                chan.sock.settimeout(timeout + channel.AUTH_TIMEOUT)
                body = chan.recv_body()
                if body is None:
                    return False  # refused
                seq, ack, payload = session.split(body)
                if not isinstance(chan.decode(payload), protocol.Resumed):
                    return False
            else:  # the hello may never have arrived: it goes again, first, and the driver tells them apart
                ack = 0
            with self._cond:
                if self._closing.is_set():
                    return True
                for frame in self.session.unacknowledged(ack):
                    chan.send_encoded(frame)
                chan.sock.settimeout(SEND_SECONDS)
                self.chan, self._thread, chan = chan, None, None
                away = time.monotonic() - (self.broke_at or time.monotonic())
                self.heard, self.broke_at = time.monotonic(), None
                self._cond.notify_all()
            _say(f"sparktrain rank {self.rank}: reconnected to the driver after {away:.1f} s")
            return True
        finally:
            if chan is not None:
                chan.close()


def _say(line: str) -> None:
    """A line for the executor's log: the rank's task's own stderr."""
    print(line, file=sys.stderr, flush=True)
