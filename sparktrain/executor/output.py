"""A rank's output and its line to the driver, as the barrier task sees them.

:class:`RankIO` holds what the task knows of its rank while it runs: its link to the driver
(``link``: the channel across connections), the output tail kept for a failure report, and the
copy of the output written to storage (``log_url``). :meth:`RankIO.pump` forwards the rank
process's output, line by line as a terminal would show it (``termline``: no ``\\r``, ``\\b`` or
escape codes), until the process exits or the driver says stop; the line being drawn (a progress
bar) goes to the driver as a live line too. While the link reconnects, lines are kept for the
new connection; once it has given up, they go to the executor's log.
"""
from __future__ import annotations

import collections
import os
import selectors
import sys
import time

from ..seam import channel, protocol, session
from ..host.tflog import StartupFilter
from ..errors import RankFailure
from ..seam.spec import TaskSpec
from .link import Link
from .stacks import StackDump, beat
from .supervisor import ChildProcess
from .termline import TermLine

#: Lines of output each rank keeps for its failure report.
TAIL_LINES = 100
#: Longest output line forwarded; longer lines are split.
MAX_LINE = 16 * 1024
#: Seconds between two sends of a stream's line being drawn (a progress bar's state).
LIVE_SECONDS = 0.25
class RankIO:
    """The state of one rank while it runs."""

    def __init__(self, spec: TaskSpec, rank: int, host: str):
        self.spec = spec
        self.rank = rank
        self.host = host
        self.local_rank = 0
        #: The barrier task's partition (-1 in local mode); the driver maps Spark's failed task to this rank.
        self.partition = -1
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: The channel to the driver, once the rank has one (``sparktrain.executor.link``).
        self.link: Link | None = None
        self.abort_reason: str | None = None
        #: When (wall clock) the rank was told to stop: a failure its process recorded before then is its own.
        self.aborted_at = float("inf")
        #: Whether the rank's process had already exited when it was told to stop.
        self.exited_before_abort = False
        #: When (wall clock) this task first saw the rank's process end (its output closed, or it
        #: exited): the time of a failure the process could not record itself (a kill), so that a
        #: peer's error about the closed connection does not pass for the root cause.
        self.ended_at: float | None = None
        self.show = spec.output_ranks is None or rank in spec.output_ranks
        #: Drops TensorFlow's start-up lines as the rank's TF_CPP_MIN_LOG_LEVEL asks (set with the level).
        self.startup = StartupFilter(0)
        #: Where the output also goes when the run has a log_url (see sparktrain.storage.outputlog).
        self.log = None
        #: The key the ranks' collective connections prove they hold (see collective_key).
        self.collective_key = b""
        #: The native engine's progress record of the rank (sent with every beat), once it is known.
        self.progress_path: str | None = None
        self.stacks = StackDump()
        #: When (monotonic) each stream's line being drawn was last sent (see _live).
        self._live_sent: dict[str, float] = {}

    def open_log(self) -> None:
        if self.spec.log_target is None or not self.show:
            return
        import cloudpickle

        from ..storage.outputlog import RankLog

        url = self.spec.log_target
        try:
            options = cloudpickle.loads(self.spec.storage_options) if self.spec.storage_options else None
            self.log = RankLog(url, options, self.spec.run_id, self.rank)
        except Exception as e:  # noqa: BLE001 - the output's copy must never stop training
            print(f"sparktrain rank {self.rank}: cannot write output under {url}: {e}", file=sys.stderr)

    def flush_log(self, force: bool = False) -> None:
        if self.log is None:
            return
        try:
            self.log.flush(force)
        except Exception as e:  # noqa: BLE001 - the output's copy must never stop training
            print(f"sparktrain rank {self.rank}: stopped writing output to storage: {e}", file=sys.stderr)
            self.log = None

    # -- channel -----------------------------------------------------------------------------
    def send(self, msg: protocol.FromRank, numbered: bool = True) -> bool:
        """Send to the driver (kept for the next connection while the link reconnects); False if
        there is no channel, or it gave up. ``numbered``: False for what is stale once a newer
        one is sent (beats, the line being drawn), which no reconnect sends again."""
        return self.link is not None and self.link.send(msg, numbered)

    def settle(self) -> bool:
        """Whether the driver has received everything sent (waiting within the reconnect window)."""
        return self.link is not None and self.link.settle(session.reconnect_window(self.spec.heartbeat_timeout))

    def close_link(self) -> None:
        """Say goodbye to the driver, once it has everything, and close the channel."""
        if self.link is not None:
            self.link.close(session.reconnect_window(self.spec.heartbeat_timeout))

    def failure(self, **kw) -> RankFailure:
        # The child records when its exception happened; otherwise, when its process ended.
        kw.setdefault("time", self.ended_at or time.time())
        return RankFailure(rank=self.rank, host=self.host, local_rank=self.local_rank,
                           output_tail=tuple(self.tail), **kw)

    # -- output ------------------------------------------------------------------------------
    def emit(self, stream: str, line: str) -> None:
        if self.startup.drops(line, stream):
            return
        self.tail.append(line if stream == "stdout" else f"[stderr] {line}")
        if not self.show:
            return
        if self.log is not None:
            self.log.add(stream, line, time.time())
        if not self.send(protocol.Output(stream, line, time.time(), drawn=getattr(line, "drawn", False) or None)):
            print(f"[{self.rank}]<{stream}>:{line}", file=sys.stderr if stream == "stderr" else sys.stdout)

    def pump(self, child: ChildProcess) -> None:
        """Forward the child's output until it exits or the driver says stop."""
        sel = selectors.DefaultSelector()
        terms, pipes = {}, {}
        for stream, f in (("stdout", child.stdout), ("stderr", child.stderr)):
            os.set_blocking(f.fileno(), False)
            sel.register(f.fileno(), selectors.EVENT_READ, stream)
            terms[stream], pipes[stream] = TermLine(MAX_LINE), f.fileno()
        sel.register(child.stacks, selectors.EVENT_READ, "stacks")
        driver_sock = None
        held = False  # the child's output is not read while the driver has too much of it to catch up on
        exited_at = None
        beat_at = time.monotonic() - channel.BEAT_SECONDS  # the first beat at once
        try:
            while pipes:
                driver_sock = self._watch_driver(sel, driver_sock)
                held = self._hold(sel, pipes, held)
                now = time.monotonic()
                if self.link is not None and now - beat_at >= channel.BEAT_SECONDS:
                    beat_at = now
                    self.send(beat(self.progress_path if self.spec.stall_warning else None), numbered=False)
                    self.link.check_silence(now)
                self._check_driver(child, now)
                for stream, term in terms.items():
                    self._live(stream, term, now)
                stacks = self.stacks.done(now)
                if stacks is not None:
                    self.send(protocol.Stacks(stacks))
                for key, _ in sel.select(timeout=0.5 if self.stacks.asked is None and not held else 0.1):
                    if key.data == "driver":
                        self._on_driver_message(child, key.fileobj)
                    elif key.data == "stacks":
                        if not self.stacks.read(key.fd, time.monotonic()):
                            sel.unregister(key.fileobj)
                    else:
                        self._read_pipe(sel, key, terms, pipes)
                self.flush_log()
                if child.exited():
                    self.ended_at = self.ended_at or time.time()
                    # A grandchild may hold the pipes open after the child exited: give the
                    # last lines a moment to arrive, then stop waiting for EOF.
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 1.0:
                        break
        finally:
            sel.close()
            self.flush_log(force=True)
            if self.spec.heartbeat_timeout:
                self.send(protocol.Quiet())  # no more beats: the result may take a while to go up

    def _read_pipe(self, sel: selectors.BaseSelector, key, terms: dict, pipes: dict) -> None:
        """Take what the child wrote on one stream; at its end, the stream's last line."""
        try:
            chunk = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            sel.unregister(key.fileobj)
            del pipes[key.data]
            if not pipes and self.ended_at is None:
                self.ended_at = time.time()
            for line in terms[key.data].close():
                self.emit(key.data, line)
            return
        for line in terms[key.data].feed_bytes(chunk):
            self.emit(key.data, line)
        self._live(key.data, terms[key.data], time.monotonic())

    def _watch_driver(self, sel: selectors.BaseSelector, registered):
        """The driver's connection in the selector: a new one once the link reconnected."""
        sock = self.link.sock if self.link is not None else None
        if sock is not registered:
            if registered is not None:
                try:
                    sel.unregister(registered)
                except (KeyError, ValueError):
                    pass
            if sock is not None:
                sel.register(sock, selectors.EVENT_READ, "driver")
        return sock

    def _hold(self, sel: selectors.BaseSelector, pipes: dict, held: bool) -> bool:
        """Stop reading the child's output while the link keeps too much the driver has not
        acknowledged (the child then waits on its pipes), and read it again once it has less."""
        hold = self.link is not None and self.link.backlogged()
        if hold != held:
            for stream, fd in pipes.items():
                if hold:
                    sel.unregister(fd)
                else:
                    sel.register(fd, selectors.EVENT_READ, stream)
        return hold

    def _check_driver(self, child: ChildProcess, now: float) -> None:
        """Stop the rank when the driver has said nothing (not even a beat) for heartbeat_timeout:
        this host is cut off from it, or the driver is gone, and the run cannot go on here."""
        limit = self.spec.heartbeat_timeout
        if self.link is None or not limit or now - self.link.heard <= limit or self.abort_reason is not None:
            return
        self.aborted_at, self.exited_before_abort = time.time(), child.exited()
        away = "" if self.link.chan is not None else ", and its channel could not reconnect"
        self.abort_reason = (f"it heard nothing from the driver for {now - self.link.heard:.0f} s (heartbeat_timeout "
                             f"{limit:g} s{away}): its host {self.host} is cut off from the driver, or the driver "
                             "stopped")
        child.stop(self.spec.grace_period)

    def _live(self, stream: str, term: TermLine, now: float) -> None:
        """Send the line being drawn (a progress bar) as it stands, at most every LIVE_SECONDS per
        stream; the driver decides whether and how to show it. Its finished state comes as a line."""
        if not term.changed or self.link is None or not self.show \
                or now - self._live_sent.get(stream, 0.0) < LIVE_SECONDS:
            return
        self._live_sent[stream] = now
        text = term.seen()
        if text:  # an empty line being drawn is a line just finished: that line has gone already
            self.send(protocol.Output(stream, text, time.time(), live=True), numbered=False)

    def _on_driver_message(self, child: ChildProcess, sock) -> None:
        msg = self.link.receive(sock)  # None: nothing new (a broken connection: the link reconnects)
        if isinstance(msg, protocol.AskStacks) and not self.stacks.ask(child, time.monotonic()):
            self.send(protocol.Stacks(""))  # it has exited: nothing to wait for
        if isinstance(msg, protocol.Abort) and self.abort_reason is None:
            self.aborted_at, self.exited_before_abort = time.time(), child.exited()
            self.abort_reason = msg.reason
            child.stop(self.spec.grace_period)


