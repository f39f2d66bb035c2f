"""One attempt of a run: start the gang, supervise it until it ends, return rank 0's value or raise.

One :class:`Attempt` carries out what ``sparktrain.driver.supervise.supervision`` decides: it feeds that
pure core the events of the run's channel (``sparktrain.driver.supervise.server``) and of its job
(``sparktrain.driver.launch.jobs``) with the time, and does the actions it returns (stop the ranks,
cancel the job, log). Its one loop also gives the run's size policy a look on each turn (an elastic
run's slots, and the resize the core decides from them: ``sparktrain.driver.supervise.elastic``), on
the loop's own thread. ``sparktrain.driver.supervise.attempts`` starts attempts until
one succeeds, or the core gives up.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import TYPE_CHECKING, IO, Any, Callable

from ...seam import channel
from ...errors import RankFailedError, RankFailure, RunCancelledError, RunTimeoutError, SparkTrainError
from ...seam.protocol import failures_in
from ...seam.spec import SPILLED, TaskSpec
from ..show.display import Display
from ..show.spark_errors import read_spark_failure
from ..show.results import byte_size, load_result, placement
from .interrupts import Interrupts
from .server import Closed, DriverServer, Event, Interrupted, JobDone, Output, Progress, Refused, Rejoined, Stacks
from .stalls import StallWatch, collect_stacks, user_frames
from . import supervision as core

if TYPE_CHECKING:
    from ..launch.jobs import Job, JobFactory

log = logging.getLogger("sparktrain")

#: How often the loop looks at its clocks when no event arrives.
TICK = 0.1
#: Seconds the driver waits for the ranks' last messages after the job ended.
DRAIN_SECONDS = 5.0
#: Seconds the driver keeps cancelling a job that does not end.
CANCEL_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every attempt of one ``run`` call shares."""

    run_id: str
    fn_name: str
    stdout: IO[str] | None
    stderr: IO[str] | None
    timestamps: bool
    #: Seconds the whole run may take (every attempt together); None: no limit.
    timeout: float | None
    #: 0 warnings only, 1 progress, 2 debug (and every C++ log line of the ranks).
    verbose: int = 1
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: Where the ranks' lines, their progress bars and the run's status are shown (``display``).
    display: Display | None = None

    def __post_init__(self):
        if self.display is None:
            object.__setattr__(self, "display", Display(self.stdout, self.stderr, self.timestamps, self.verbose,
                                                        title=self.run_id))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self, event: Output) -> None:
        """One rank's output line, prefixed ``[rank]<stream>:`` (and the time, if asked for), or the
        line it is drawing (a progress bar), as the display shows such lines."""
        self.display.write(event.rank, event.stream, event.line, event.time, event.live, event.drawn)


class NoChannel:
    """The driver's end where ranks meet through Spark's barrier allGather: no channel, nothing to
    tell the ranks (Spark's cancellation ends them); the job's end and interrupts still arrive on
    its queue, as they do on a channel's."""

    def __init__(self):
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def abort(self, reason: str) -> None:
        pass

    def wait_disconnected(self, timeout: float) -> None:
        pass

    def request_stacks(self, ranks) -> None:
        pass

    def job_ended(self) -> None:
        pass

    def unreachable(self) -> set[int]:
        return set()

    def close(self) -> None:
        pass


class Attempt:
    """One attempt: its own secret, channel and job, supervised until the job ends. ``max_attempts``:
    how many the run may have (0: no bound), for the log; ``look``: what the run's size policy looks
    at, called on each turn of the loop (it keeps its own interval: an elastic run's slots, once a
    second)."""

    def __init__(self, info: RunInfo, spec: TaskSpec, max_attempts: int, make_job: "JobFactory", host: str,
                 look: Callable[[], None] = lambda: None):
        self.info = info
        self.max_attempts = max_attempts
        self.look = look
        started = time.monotonic()
        remaining = None if info.timeout is None else info.timeout - info.elapsed()
        self.limits = core.Limits(spec.size, started, spec.start_timeout,
                                  None if remaining is None else started + remaining,
                                  f"run {info.run_id} of {info.fn_name}", info.timeout)
        self.state: core.State = core.Starting()
        self.server: DriverServer | NoChannel
        if spec.driver_address is not None:
            secret = channel.new_secret()
            self.server = DriverServer(secret, spec.size, host, heartbeat_timeout=spec.heartbeat_timeout,
                                       encrypted=spec.encrypted, attempt=spec.attempt)
            spec = dataclasses.replace(spec, secret=secret, driver_address=self.server.address)
        else:
            self.server = NoChannel()
            self.state = core.Running(core.Seen())  # ranks rendezvous through Spark; nothing tells the driver
        self.spec = spec
        #: The one source of events the loop reads, whichever way the ranks meet: the ranks' (on a
        #: channel), the job's end and interrupts.
        self.events: queue.SimpleQueue[Event] = self.server.events
        try:
            self.job: "Job" = make_job(spec, lambda: self.events.put(JobDone()))
        except BaseException:
            self.server.close()
            raise
        #: Where each rank checked in, kept as the core's state says (the stall watch reads it).
        self.hosts: dict[int, str] = {}
        self.disconnected: set[int] = set()
        self._job_seen_done = False
        self._stalls_checked = float("-inf")
        # Ctrl-C (a notebook's stop button) is raised at the top of a turn of the supervision loop,
        # never inside one of its waits (see sparktrain.driver.supervise.interrupts).
        self.interrupts = Interrupts(lambda: self.events.put(Interrupted()))
        self.stalls = StallWatch(spec.size, spec.stall_warning, self.hosts, self.server.request_stacks)

    # -- the loop ----------------------------------------------------------------------------------
    def supervise(self) -> Any:
        """Start the job and watch it until it ends; return rank 0's value or raise one error."""
        tail = self._output_tail()
        try:
            with self.interrupts:
                self._supervise()
        finally:
            self.server.close()
            if tail is not None:
                tail.stop()
        return self._outcome()

    def _supervise(self) -> None:
        try:
            self.job.start()
            bound = f" of {self.max_attempts}" if self.max_attempts else ""
            of = f" (attempt {self.spec.attempt}{bound})" if self.max_attempts != 1 else ""
            log.info("sparktrain: launching %d rank(s) of %s, run %s%s; %s", self.spec.size, self.info.fn_name,
                     self.info.run_id, of, "encrypted (AES-256-GCM between hosts and on the driver's channel)"
                     if self.spec.encrypted else "not encrypted")
            while not isinstance(self.state, core.Ended):
                self.interrupts.check()
                self._handle(self._next_event(TICK))
                self._step()
                self.look()
                self.info.display.tick()
                hush = getattr(self.job, "hush", None)  # Spark's own console progress bar, where it draws one
                if hush is not None:
                    hush(time.monotonic())
            self._drain()
        except BaseException as e:
            # KeyboardInterrupt or any driver-side error: stop everything, after saying what every
            # rank was doing when the user stopped it.
            if isinstance(e, KeyboardInterrupt):
                try:
                    self._print_stacks()
                except KeyboardInterrupt:
                    pass  # interrupted again: stop the ranks without them
            self._stop("the driver was interrupted")
            raise

    def _output_tail(self):
        """Without a channel, and with a log_url, the ranks' output comes here through storage."""
        if self.spec.log_target is None or self.spec.driver_address is not None:
            return None
        import cloudpickle

        from ...storage.outputlog import DriverTail

        url = self.spec.log_target
        options = cloudpickle.loads(self.spec.storage_options) if self.spec.storage_options else None
        write = lambda rank, stream, line, at: self.info.write(Output(rank, stream, line, at))  # noqa: E731
        return DriverTail(url, options, self.info.run_id, write).start()

    def _step(self, event: core.Event = None) -> None:
        """Feed the core ``event`` (None: the clock's tick; the job's end is noticed here), then
        do what it asks."""
        if event is None and not self._job_seen_done and self.job.done():
            self._job_seen_done = True
            self.server.job_ended()  # a rank whose connection dropped will not come back now
            event = core.JobEnded(self.job.error is not None)
        now = time.monotonic()
        self.state, actions = core.step(self.state, event, now, self.limits)
        if isinstance(event, core.CheckedIn):  # per rank, not the whole map per event: O(1) at any size
            self.hosts[event.rank] = self.state.seen.hosts[event.rank]
        for action in actions:
            if isinstance(action, core.Started):
                log.info("sparktrain: all %d rank(s) started in %.2f s on %s", self.spec.size, action.seconds,
                         placement(self.hosts))
            elif isinstance(action, core.Stop):
                self._stop(action.reason)
        if isinstance(self.state, core.Running) and now - self._stalls_checked >= TICK:
            # Every rank's progress is compared: once a tick, not once per event.
            self._stalls_checked = now
            report = self.stalls.check(now)
            if report:
                log.warning("sparktrain: run %s: %s", self.info.run_id, report)

    def _next_event(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, event: Event | None) -> None:
        """Every event the server or the job produces is handled here."""
        if isinstance(event, Output):
            self.info.write(event)
        elif isinstance(event, core.RankFailed):
            self._step(event)
        elif isinstance(event, core.CheckedIn):
            self.info.display.rank_up(event.rank, event.host)
            self._step(event)
        elif isinstance(event, Progress):
            self.stalls.progress(event.rank, event.at, event.time)
        elif isinstance(event, Stacks):
            self.stalls.stacks(event.rank, event.text)
        elif isinstance(event, Closed):
            self.disconnected.add(event.rank)
        elif isinstance(event, Rejoined):
            self.disconnected.discard(event.rank)
            log.warning("sparktrain: run %s: rank %d's channel to the driver dropped and came back after %.1f s, "
                        "on a new connection; nothing sent either way was lost", self.info.run_id, event.rank,
                        event.seconds)
        elif isinstance(event, Refused):
            log.warning("sparktrain: refused a connection from %s (%s)", event.peer, event.reason)
        elif isinstance(event, (JobDone, Interrupted)) or event is None:
            pass  # _step looks at the job itself

    def _print_stacks(self) -> None:
        """Every running rank's Python stacks, printed where the run prints (on an interrupt)."""
        if not self.hosts or not isinstance(self.state, core.Running):
            return  # no rank checked in on a channel

        def next_stacks(timeout: float):
            self.interrupts.check(allowed=1)
            event = self._next_event(min(timeout, TICK))
            if isinstance(event, Stacks):
                return event.rank, event.text
            self._handle(event)
            return None

        ranks = sorted(self.hosts)
        got = collect_stacks(ranks, self.server.request_stacks, next_stacks)
        for rank in ranks:
            text = user_frames(got.get(rank, "")) or "(no stack arrived)"
            log.warning("sparktrain: run %s was interrupted; rank %d (%s) was at:\n%s", self.info.run_id, rank,
                        self.hosts[rank], "".join("  " + line for line in text.splitlines(True)).rstrip())

    def _drain(self) -> None:
        """Handle what ranks sent before they disconnected (their last output, failure reports);
        ranks found unreachable send nothing more."""
        deadline = time.monotonic() + DRAIN_SECONDS
        waiting = set(self.hosts) - self.disconnected
        while True:
            waiting -= self.server.unreachable()
            event = self._next_event(deadline - time.monotonic() if waiting else 0)
            if event is None:
                return
            self._handle(event)
            if isinstance(event, Closed):
                waiting.discard(event.rank)
            self.interrupts.check()

    def _stop(self, reason: str) -> None:
        """Stop every rank: ask them (they terminate their process groups), then cancel the job."""
        if not isinstance(self.state, (core.Stopping, core.Ended)):
            self.state = core.Stopping(self.state.seen, None, reason)
        self.server.abort(reason)
        # Ranks stop their process groups within the grace period, then disconnect and end
        # their tasks; cancelling the Spark job first would kill them without that grace.
        # Wait for that even when the Spark job has already ended (cancelled, or a task lost):
        # Spark kills its tasks in its own time, and the ranks' processes may outlive that.
        self.server.wait_disconnected(self.spec.grace_period + 2.0)
        # Cancel until the job ends: a cancel that lands before the job thread has submitted
        # its stage would otherwise be lost.
        deadline = time.monotonic() + CANCEL_SECONDS
        while not self.job.done() and time.monotonic() < deadline:
            try:
                self.job.cancel()
            except Exception as e:  # noqa: BLE001
                log.warning("sparktrain: could not cancel the Spark job group: %s", e)
            self.job.wait(1.0)
        if not self.job.done():
            log.warning("sparktrain: the run's tasks did not end within %.0f s of being cancelled", CANCEL_SECONDS)

    # -- the outcome -------------------------------------------------------------------------------
    def _outcome(self) -> Any:
        seen = self.state.seen
        if seen.failures:
            raise RankFailedError(seen.failures, stall=self.stalls.last_report or "")
        error = self.state.error if isinstance(self.state, (core.Stopping, core.Ended)) else None
        if isinstance(error, RunTimeoutError) and self.stalls.last_report:
            error = RunTimeoutError(f"{error}\n\nThe last stall report before the timeout:\n{self.stalls.last_report}")
        if error is not None:
            raise error
        if self.job.error is not None:
            raise self._spark_failure(self.job.error) from self.job.error
        data = self.job.result_bytes()
        value = load_result(data)
        self._write_tails()
        if self.spec.checkpoint is not None:
            returned = f"checkpoint at {value}"
        else:
            returned = (f"{byte_size(len(data))} pickled" if data and not data.startswith(SPILLED) else
                        "a value spilled to storage" if data else "nothing")
        start_seconds = getattr(self.state, "start_seconds", None)
        started = (f"ranks started in {start_seconds:.2f} s" if start_seconds is not None
                   else "ranks rendezvoused through Spark")
        # The display's summary says so where the user looks (verbose >= 1); the log keeps it for debugging.
        log.debug("sparktrain: run %s of %s finished in %.2f s (%s); rank 0 returned %s", self.info.run_id,
                  self.info.fn_name, self.info.elapsed(), started, returned)
        self.info.display.outcome = f"{self.info.fn_name} finished ({started}); rank 0 returned {returned}"
        return value

    def _write_tails(self) -> None:
        """Output that could not stream live (see ``TaskSpec.return_output``): each rank's tail, now."""
        tails = getattr(self.job, "output_tails", dict)()
        now = time.time()
        for rank in sorted(tails):
            for line in tails[rank]:
                stream, text = ("stderr", line[len("[stderr] "):]) if line.startswith("[stderr] ") else ("stdout", line)
                if self.spec.output_ranks is None or rank in self.spec.output_ranks:
                    self.info.write(Output(rank, stream, text, now))

    def _spark_failure(self, error: BaseException) -> SparkTrainError:
        """The error for a Spark job that failed without a report from the ranks' channel."""
        reported = failures_in(str(error))
        if reported:
            return RankFailedError(reported)
        text = str(error)
        run = f"run {self.info.run_id} of {self.info.fn_name}"
        if "cancel" in text.lower():
            return RunCancelledError(f"{run} was cancelled (Spark job group sparktrain-{self.info.run_id})")
        # Lead with the executor's own Python exception, where Spark carried one, then Spark's context.
        failure = read_spark_failure(error)
        rank = self.state.seen.partitions.get(failure.partition) if failure.partition is not None else None
        if rank is not None and rank in self.hosts:
            # The rank's task died under it (its Python worker or executor was killed) before
            # sparktrain could report anything: name the rank, and what Spark saw.
            died = ("its Spark task died without a report from the rank (the executor's Python worker or JVM was "
                    f"killed, or ran out of memory); Spark says: {failure.context}")
            return RankFailedError([RankFailure(
                rank=rank, host=self.hosts[rank], time=time.time(),
                local_rank=sum(1 for r, h in self.hosts.items() if r < rank and h == self.hosts[rank]),
                message=f"{failure.cause} ({died})" if failure.cause else died)])
        return SparkTrainError(failure.message(run, rank))

