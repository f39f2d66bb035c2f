"""The driver's end of the run's channel: it accepts ranks, does the rendezvous, and turns what
ranks send into events.

Events are small frozen dataclasses put on one queue, which the attempt's supervision loop
(``sparktrain.driver.supervise.attempt``) consumes on the thread that called ``run``, so output is written
where a notebook shows it: in the running cell.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from typing import Union

from ...seam import channel, protocol
from ...seam.channel import Channel
from ...errors import RankFailure
from .connections import Connections
from .supervision import CheckedIn, RankFailed

log = logging.getLogger("sparktrain")


@dataclasses.dataclass(frozen=True)
class Output:
    """One line a rank printed, on ``stream`` ("stdout" or "stderr"), at wall-clock ``time``."""

    rank: int
    stream: str
    line: str
    time: float
    #: The line being drawn (a progress bar) as it stands, not a finished line (see ``display``).
    live: bool = False
    #: A finished line that was a progress bar (it was redrawn in place first).
    drawn: bool = False


@dataclasses.dataclass(frozen=True)
class Progress:
    """A rank's beat carried where its collectives stand (``sparktrain.engine.progress.read``),
    received at monotonic ``time``."""

    rank: int
    at: dict
    time: float


@dataclasses.dataclass(frozen=True)
class Stacks:
    """A rank's threads' Python stacks, as asked for (``request_stacks``); "" when it could not answer."""

    rank: int
    text: str


@dataclasses.dataclass(frozen=True)
class Closed:
    """A rank's connection ended: its task is done with its processes, or it died."""

    rank: int


@dataclasses.dataclass(frozen=True)
class Refused:
    """A connection that did not prove it holds the run's secret was dropped."""

    peer: str
    reason: str


@dataclasses.dataclass(frozen=True)
class JobDone:
    """The Spark (or local) job ended; put on the queue by the job itself, to wake the loop at once."""


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """The driver got SIGINT; put on the queue by the signal handler, to wake the loop at once."""


Event = Union[CheckedIn, Output, RankFailed, Progress, Stacks, Closed, Refused, JobDone, Interrupted]


class DriverServer:
    """Accepts ``size`` ranks on ``host``; answers the rendezvous; emits :data:`Event` on ``events``.

    Liveness: while the run goes on, the server beats every second on every channel, and each
    running rank's task does the same. From the rendezvous on, a rank that says nothing for
    ``heartbeat_timeout`` seconds (0: never) is reported as failed, its host unreachable: a host
    whose network went down sends no reset, and nothing else would tell.
    """

    def __init__(self, secret: bytes, size: int, host: str, heartbeat_timeout: float = 0.0, encrypted: bool = False):
        self.secret = secret
        #: Every channel in AES-256-GCM (``sparktrain.seam.channel``); else authenticated only.
        self.encrypted = encrypted
        self.size = size
        # A SimpleQueue: its put and get take no lock written in Python, so an interrupt in the
        # supervision loop cannot leave one held, and its put is safe in a signal handler.
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._hellos: dict[int, protocol.CheckedIn] = {}
        self._closing = False
        self._abort_reason: str | None = None
        self._all_closed = threading.Condition(self._lock)
        self.heartbeat_timeout = heartbeat_timeout
        #: When each beating rank was last heard from (monotonic); a rank joins at its first beat.
        self._heard: dict[int, float] = {}
        #: Ranks reported unreachable: nobody waits for their connections to close.
        self._unreachable: set[int] = set()
        self._beats = threading.Event()  # set: stop beating
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(max(16, 2 * size))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        # Every connection is read on one thread (connections.py), however many ranks there are.
        self._conns = Connections(self._listener, secret, encrypted, self)
        self._beat_thread = threading.Thread(target=self._beat_loop, name="sparktrain-beat", daemon=True)
        if heartbeat_timeout:
            self._beat_thread.start()

    # -- connections (the callbacks of connections.Connections, on its thread) -------------------
    def hello(self, chan: Channel, msg: protocol.CheckedIn) -> bool:
        return self._register(msg.rank, chan, msg)

    def message(self, rank: int, msg: protocol.FromRank) -> None:
        if isinstance(msg, (protocol.Beat, protocol.Quiet)) or rank in self._heard:
            with self._lock:
                if isinstance(msg, protocol.Quiet):
                    self._heard.pop(rank, None)  # its process has ended; the result follows
                else:
                    self._heard[rank] = time.monotonic()
        self._dispatch(rank, msg)

    def closed(self, rank: int | None) -> None:
        with self._lock:
            self._heard.pop(rank, None)
            self._all_closed.notify_all()  # wait_disconnected looks again
        if rank is not None:
            self.events.put(Closed(rank))

    def refused(self, peer: str, reason: str) -> None:
        self.events.put(Refused(peer, reason))  # the attempt logs it, once

    def dropped(self, rank: int, reason: str) -> None:
        log.warning("sparktrain: dropped rank %d's connection: %s", rank, reason)

    def _register(self, rank: int, chan: Channel, hello: protocol.CheckedIn) -> bool:
        with self._lock:
            if not 0 <= rank < self.size or rank in self._hellos or self._closing or self._abort_reason:
                # A second hello for a rank is a retried Spark task; sparktrain does not retry
                # inside a stage, so that attempt is told to stop at once. A rank that starts
                # after the run was stopped is told so too.
                why = ("duplicate rank" if rank in self._hellos else "unknown rank") + \
                    f" {rank}: this run does not accept it"
                self._send_quietly(chan, protocol.Abort(self._abort_reason or why))
                return False
            self._channels[rank] = chan
            self._hellos[rank] = hello
            complete = len(self._hellos) == self.size
        self.events.put(CheckedIn(rank, hello.host, hello.partition))
        if complete:
            self._send_peers()
        return True

    def _send_peers(self) -> None:
        with self._lock:
            # Encoded once: every rank gets the same answer, of a size that grows with the ranks.
            peers = protocol.encode(protocol.peers(self._hellos.values()))
            channels = list(self._channels.values())
            if self.heartbeat_timeout:  # from now on every rank starts its process and beats
                now = time.monotonic()
                for r in range(self.size):
                    self._heard.setdefault(r, now)
        for chan in channels:
            self._send_quietly(chan, peers)

    def _dispatch(self, rank: int, msg: protocol.FromRank) -> None:
        if isinstance(msg, protocol.Output):
            self.events.put(Output(rank, msg.stream, msg.line, msg.time, bool(msg.live), bool(msg.drawn)))
        elif isinstance(msg, protocol.RankFailed):
            self.events.put(RankFailed(msg.failure))
        elif isinstance(msg, protocol.Beat) and msg.at is not None:
            self.events.put(Progress(rank, msg.at, time.monotonic()))
        elif isinstance(msg, protocol.Stacks):
            self.events.put(Stacks(rank, msg.text))

    def _beat_loop(self) -> None:
        while not self._beats.wait(channel.BEAT_SECONDS):
            with self._lock:
                channels = list(self._channels.values())
                now = time.monotonic()
                silent = [(r, now - t) for r, t in self._heard.items()
                          if now - t > self.heartbeat_timeout and not self._channels[r].closed]
                for r, _ in silent:
                    del self._heard[r]  # reported once
                    self._unreachable.add(r)
                hosts = {r: self._hellos[r].host for r, _ in silent}
                local = _local_ranks(self._hellos, hosts) if silent else {}
            beat = protocol.encode(protocol.Beat())
            for chan in channels:
                self._send_quietly(chan, beat)
            for r, quiet in silent:
                self.events.put(RankFailed(RankFailure(
                    rank=r, host=hosts[r], local_rank=local[r],
                    exc_type="HostUnreachable",
                    message=f"host {hosts[r]} became unreachable: no word from rank {r} for {quiet:.0f} s "
                            f"(heartbeat_timeout {self.heartbeat_timeout:g} s). Its network went down or the host "
                            "stopped; ranks elsewhere were stopped", time=time.time())))

    @staticmethod
    def _send_quietly(chan: Channel, msg: protocol.FromDriver | bytes) -> None:
        """Send ``msg`` (or its encoding); a send that fails ends the connection: what was sent of a
        frame cannot be taken back."""
        try:
            chan.send_encoded(msg if isinstance(msg, bytes) else protocol.encode(msg))
        except OSError:
            try:  # the connections' loop reads the end of it, and closes it there
                chan.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- control -------------------------------------------------------------------------------
    def missing_ranks(self) -> list[int]:
        with self._lock:
            return [r for r in range(self.size) if r not in self._hellos]

    def connected_ranks(self) -> list[int]:
        with self._lock:
            return [r for r, c in self._channels.items() if not c.closed]

    def unreachable(self) -> set[int]:
        """The ranks reported unreachable (no word from them for ``heartbeat_timeout``)."""
        with self._lock:
            return set(self._unreachable)

    def wait_disconnected(self, timeout: float) -> bool:
        """Wait until every rank that checked in has disconnected, but those found unreachable; False
        if some still are connected after ``timeout``."""
        with self._lock:
            return self._all_closed.wait_for(
                lambda: all(c.closed for r, c in self._channels.items() if r not in self._unreachable),
                timeout=max(0.0, timeout))

    def request_stacks(self, ranks) -> None:
        """Ask these ranks' tasks for their processes' Python stacks (answered as :class:`Stacks`)."""
        with self._lock:
            channels = [self._channels[r] for r in ranks if r in self._channels]
        for chan in channels:
            self._send_quietly(chan, protocol.AskStacks())

    def abort(self, reason: str) -> None:
        """Tell every connected rank to stop its processes now, and every later one not to start."""
        with self._lock:
            self._abort_reason = self._abort_reason or reason
            channels = list(self._channels.values())
        abort = protocol.encode(protocol.Abort(reason))
        for chan in channels:
            self._send_quietly(chan, abort)

    def close(self) -> None:
        self._beats.set()
        with self._lock:
            self._closing = True
        # Stops the loop and closes every connection; the listener is closed after it.
        self._conns.close()
        self._listener.close()
        if self._beat_thread.ident is not None:
            self._beat_thread.join(timeout=5)


def _local_ranks(hellos: dict[int, protocol.CheckedIn], ranks: dict[int, str]) -> dict[int, int]:
    """Each of ``ranks``' local rank: how many ranks below it checked in from its host. One pass
    over the ranks, however many went silent at once."""
    counts: dict[str, int] = {}
    local = {}
    for k in sorted(hellos):
        host = hellos[k].host
        if k in ranks:
            local[k] = counts.get(host, 0)
        counts[host] = counts.get(host, 0) + 1
    return local
