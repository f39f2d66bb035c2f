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
from .ranklinks import RankLink, end as end_connection, send_bare
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
class Rejoined:
    """A rank's channel dropped and the rank came back on a new connection, away for ``seconds``
    (the longer of the rank's silence and the driver's): nothing sent either way was lost
    (``sparktrain.seam.session``)."""

    rank: int
    seconds: float


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


Event = Union[CheckedIn, Output, RankFailed, Progress, Stacks, Closed, Rejoined, Refused, JobDone,
              Interrupted]


class DriverServer:
    """Accepts ``size`` ranks on ``host``; answers the rendezvous; emits :data:`Event` on ``events``.

    Liveness: while the run goes on, the server beats every second on every channel, and each
    running rank's task does the same; every frame acknowledges what its sender has received. From
    the rendezvous on, a rank that says nothing for ``heartbeat_timeout`` seconds (0: never) is
    reported as failed, its host unreachable: a host whose network went down sends no reset, and
    nothing else would tell. A rank whose connection ended without its goodbye may come back on a
    new one within that time (``protocol.Resume``, for attempt ``attempt``): its session goes on,
    and what each side had not acknowledged is sent again.
    """

    def __init__(self, secret: bytes, size: int, host: str, heartbeat_timeout: float = 0.0, encrypted: bool = False,
                 attempt: int = 1):
        self.secret = secret
        #: Every channel in AES-256-GCM (``sparktrain.seam.channel``); else authenticated only.
        self.encrypted = encrypted
        self.size = size
        self.attempt = attempt
        # A SimpleQueue: its put and get take no lock written in Python, so an interrupt in the
        # supervision loop cannot leave one held, and its put is safe in a signal handler.
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Each rank's session, from its hello on (``ranklinks``).
        self._links: dict[int, RankLink] = {}
        self._hellos: dict[int, protocol.CheckedIn] = {}
        self._closing = False
        self._abort_reason: str | None = None
        #: The job has ended: a rank whose connection ended is not waited for.
        self._job_over = False
        self._all_closed = threading.Condition(self._lock)
        self.heartbeat_timeout = heartbeat_timeout
        #: When each beating rank was last heard from (monotonic); a rank joins at the rendezvous.
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
        self._beat_thread.start()

    # -- connections (the callbacks of connections.Connections, on its thread) -------------------
    def hello(self, chan: Channel, msg: protocol.CheckedIn, seq: int, ack: int) -> bool:
        link = self._links.get(msg.rank)
        if link is not None and msg.session is not None and msg.session == link.token:
            # The rank's hello again, on a new connection: it broke before the first was acknowledged.
            why = self._refuse(link, msg.rank, self.attempt, msg.session) or self._resume(link, chan, ack, None)
            if why is not None:
                self.refused(_peer(chan), why)
                return False
            link.take(chan, seq, ack)
            return True
        return self._register(msg.rank, chan, msg, seq, ack)

    def resume(self, chan: Channel, msg: protocol.Resume, ack: int) -> str | None:
        link = self._links.get(msg.rank)
        return self._refuse(link, msg.rank, msg.attempt, msg.session) or \
            self._resume(link, chan, ack, protocol.Resumed(), msg.away)

    def _refuse(self, link: RankLink | None, rank: int, attempt: int, token: str) -> str | None:
        """Why a new connection may not carry on ``rank``'s session, or None when it may."""
        with self._lock:
            if attempt != self.attempt:
                return f"a resume for attempt {attempt}; this is attempt {self.attempt}"
            if link is None or link.token != token:
                return f"a resume for rank {rank} that names no session of this run"
            if link.bye or rank in self._unreachable:
                return f"a resume for rank {rank}, which " + \
                    ("said goodbye" if link.bye else "was reported unreachable")
            if not link.stale(time.monotonic()):
                return f"a resume for rank {rank}, which is connected"
        return None

    def _resume(self, link: RankLink, chan: Channel, ack: int, reply: protocol.Resumed | None,
                away: float = 0.0) -> str | None:
        """Carry ``link``'s session on ``chan``; a reason where that failed. ``away``: the seconds the
        rank says it had not heard from the driver (the driver may have heard from it later: what
        its old connection held when it closed)."""
        since = link.away_since()
        try:
            old = link.attach(chan, ack, reply)
        except protocol.ProtocolError as e:
            return f"a resume for rank {link.rank} that does not fit its session: {e}"
        except OSError as e:
            return f"the new connection of rank {link.rank} broke at once: {e}"
        if old is not None:  # a connection silent too long: the loop closes it, and its end is no break
            end_connection(old)
        now = time.monotonic()
        with self._lock:
            if link.rank in self._heard:
                self._heard[link.rank] = now
        self.events.put(Rejoined(link.rank, max(away, now - since)))
        return None

    def message(self, rank: int, chan: Channel, msg: protocol.FromRank, seq: int, ack: int) -> None:
        link = self._links[rank]
        if not link.take(chan, seq, ack):
            return  # received before, sent again after a reconnect; or from a connection replaced since
        if isinstance(msg, protocol.Bye):
            link.bye = True
        if isinstance(msg, (protocol.RankFailed, protocol.Bye)):
            link.send(_BEAT, numbered=False)  # acknowledged at once: the task waits for it
        if isinstance(msg, (protocol.Beat, protocol.Quiet, protocol.Bye)) or rank in self._heard:
            with self._lock:
                if isinstance(msg, (protocol.Quiet, protocol.Bye)):
                    self._heard.pop(rank, None)  # its process has ended; the result follows
                elif rank not in self._unreachable:
                    self._heard[rank] = time.monotonic()
        self._dispatch(rank, msg)

    def closed(self, rank: int | None, chan: Channel | None) -> None:
        link = self._links.get(rank) if rank is not None else None
        if rank is not None and (link is None or chan is None or not link.detach(chan)):
            return  # a connection replaced by the rank's new one
        with self._lock:
            if link is not None and (link.bye or self._job_over):
                self._heard.pop(rank, None)
            self._all_closed.notify_all()  # wait_disconnected looks again
        if rank is not None:
            self.events.put(Closed(rank))

    def refused(self, peer: str, reason: str) -> None:
        self.events.put(Refused(peer, reason))  # the attempt logs it, once

    def dropped(self, rank: int, reason: str) -> None:
        log.warning("sparktrain: dropped rank %d's connection: %s", rank, reason)

    def _register(self, rank: int, chan: Channel, hello: protocol.CheckedIn, seq: int, ack: int) -> bool:
        with self._lock:
            if not 0 <= rank < self.size or rank in self._hellos or self._closing or self._abort_reason:
                # A second hello for a rank is a retried Spark task; sparktrain does not retry
                # inside a stage, so that attempt is told to stop at once. A rank that starts
                # after the run was stopped is told so too.
                why = ("duplicate rank" if rank in self._hellos else "unknown rank") + \
                    f" {rank}: this run does not accept it"
                send_bare(chan, protocol.Abort(self._abort_reason or why))
                return False
            link = self._links[rank] = RankLink(rank, chan, hello.session)
            link.take(chan, seq, ack)
            self._hellos[rank] = hello
            complete = len(self._hellos) == self.size
        link.send(_BEAT, numbered=False)  # the hello acknowledged at once
        self.events.put(CheckedIn(rank, hello.host, hello.partition))
        if complete:
            self._send_peers()
        return True

    def _send_peers(self) -> None:
        with self._lock:
            # Encoded once: every rank gets the same answer, of a size that grows with the ranks.
            peers = protocol.encode(protocol.peers(self._hellos.values()))
            links = list(self._links.values())
            if self.heartbeat_timeout:  # from now on every rank starts its process and beats
                now = time.monotonic()
                for r in range(self.size):
                    self._heard.setdefault(r, now)
        for link in links:
            link.send(peers)

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
                links = list(self._links.values())
                now = time.monotonic()
                silent = [(r, now - t) for r, t in self._heard.items() if now - t > self.heartbeat_timeout] \
                    if self.heartbeat_timeout else []
                for r, _ in silent:
                    del self._heard[r]  # reported once
                    self._unreachable.add(r)
                hosts = {r: self._hellos[r].host for r, _ in silent}
                local = _local_ranks(self._hellos, hosts) if silent else {}
            for link in links:
                link.send(_BEAT, numbered=False)
            for r, quiet in silent:
                self.events.put(RankFailed(self._unreachable_failure(r, hosts[r], local[r], quiet)))

    def _unreachable_failure(self, rank: int, host: str, local_rank: int, quiet: float) -> RankFailure:
        dropped = self._links[rank].dropped if rank in self._links else None
        away = "" if dropped is None else \
            f"; its channel dropped {time.monotonic() - dropped:.0f} s ago and it did not reconnect"
        return RankFailure(
            rank=rank, host=host, local_rank=local_rank, exc_type="HostUnreachable",
            message=f"host {host} became unreachable: no word from rank {rank} for {quiet:.0f} s "
                    f"(heartbeat_timeout {self.heartbeat_timeout:g} s{away}). Its network went down or the host "
                    "stopped; ranks elsewhere were stopped", time=time.time())

    # -- control -------------------------------------------------------------------------------
    def missing_ranks(self) -> list[int]:
        with self._lock:
            return [r for r in range(self.size) if r not in self._hellos]

    def connected_ranks(self) -> list[int]:
        with self._lock:
            return [r for r, link in self._links.items() if link.connected]

    def unreachable(self) -> set[int]:
        """The ranks reported unreachable (no word from them for ``heartbeat_timeout``)."""
        with self._lock:
            return set(self._unreachable)

    def wait_disconnected(self, timeout: float) -> bool:
        """Wait until no rank that checked in is connected, but those found unreachable; False if
        some still are after ``timeout``. (One whose connection dropped gets what it was sent
        meanwhile if it comes back.)"""
        with self._lock:
            return self._all_closed.wait_for(
                lambda: not any(link.connected for r, link in self._links.items() if r not in self._unreachable),
                timeout=max(0.0, timeout))

    def job_ended(self) -> None:
        """The job is over: a rank whose connection ended is gone, not away."""
        with self._lock:
            self._job_over = True
            for r, link in self._links.items():
                if link.chan is None:
                    self._heard.pop(r, None)

    def request_stacks(self, ranks) -> None:
        """Ask these ranks' tasks for their processes' Python stacks (answered as :class:`Stacks`)."""
        with self._lock:
            links = [self._links[r] for r in ranks if r in self._links]
        ask = protocol.encode(protocol.AskStacks())
        for link in links:
            link.send(ask)

    def abort(self, reason: str) -> None:
        """Tell every rank to stop its processes now (one whose connection dropped, when it comes
        back), and every later one not to start."""
        with self._lock:
            self._abort_reason = self._abort_reason or reason
            links = list(self._links.values())
        abort = protocol.encode(protocol.Abort(reason))
        for link in links:
            link.send(abort)

    def close(self) -> None:
        self._beats.set()
        with self._lock:
            self._closing = True
        # Stops the loop and closes every connection; the listener is closed after it.
        self._conns.close()
        self._listener.close()
        if self._beat_thread.ident is not None:
            self._beat_thread.join(timeout=5)


_BEAT = protocol.encode(protocol.Beat())


def _peer(chan: Channel) -> str:
    try:
        return str(chan.sock.getpeername()[0])
    except OSError:
        return "a peer gone already"


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
