"""Attempts of one run: start the gang, supervise it until it ends, return rank 0's value or raise.

One :class:`Attempt` is a small state machine driven by the events of the run's channel
(``sparktrain.driver.server``) and by its job (``sparktrain.driver.jobs``)::

    STARTING --every rank checked in--> RUNNING
    STARTING/RUNNING --a rank failed, a timeout, the job ended under the ranks--> STOPPING
    any --the job is done--> ENDED

:func:`run_attempts` starts attempts until one succeeds, a failure is not ``retryable``, or
``max_attempts`` is spent.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import queue
import sys
import time
from typing import IO, Any, Callable

from .. import channel
from ..errors import (RankFailedError, RankFailure, RunCancelledError, RunTimeoutError, SparkTrainError,
                      StartTimeoutError)
from ..protocol import failures_in
from ..spec import SPILLED, TaskSpec
from .spark_errors import read_spark_failure
from .jobs import Job, JobFactory
from .results import byte_size, load_result, placement
from .interrupts import Interrupts
from .server import (Closed, DriverServer, Event, Failed, Hello, Interrupted, JobDone, Output, Progress, Refused,
                     Stacks)
from .stalls import StallWatch, collect_stacks, user_frames

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

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self, event: Output) -> None:
        """One rank's output line, prefixed ``[rank]<stream>:`` (and the time, if asked for)."""
        out = (self.stderr or sys.stderr) if event.stream == "stderr" else (self.stdout or sys.stdout)
        prefix = f"[{event.rank}]<{event.stream}>:"
        if self.timestamps:
            prefix = datetime.datetime.fromtimestamp(event.time).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " " + prefix
        try:
            out.write(prefix + event.line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass  # a closed stream must not stop training


def run_attempts(info: RunInfo, spec: TaskSpec, make_job: JobFactory, host: str, max_attempts: int,
                 before_retry: Callable[[], None] = lambda: None) -> Any:
    """Run the gang up to ``max_attempts`` times; every retry is logged, and counted in the final error."""
    earlier: list[str] = []
    for number in range(1, max_attempts + 1):
        if number > 1:
            before_retry()
        try:
            value = Attempt(info, dataclasses.replace(spec, attempt=number, max_attempts=max_attempts), max_attempts, make_job, host).supervise()
        except SparkTrainError as e:
            out_of_time = info.timeout is not None and info.elapsed() >= info.timeout
            if number == max_attempts or out_of_time or not e.retryable:
                if number == 1:
                    raise
                raise _with_attempts(e, number, earlier) from e
            earlier.append(_first_line(str(e)))
            log.warning("sparktrain: run %s attempt %d of %d failed: %s; starting all %d ranks again",
                        info.run_id, number, max_attempts, earlier[-1], spec.size)
            continue
        if number > 1:
            log.warning("sparktrain: run %s succeeded on attempt %d of %d, after %d failed attempt(s)",
                        info.run_id, number, max_attempts, number - 1)
        return value
    raise AssertionError("unreachable")


def _with_attempts(e: SparkTrainError, attempts: int, earlier: list[str]) -> SparkTrainError:
    if isinstance(e, RankFailedError):
        return RankFailedError(e.failures, attempts=attempts, earlier=earlier, stall=e.stall)
    history = "; ".join(f"attempt {i}: {why}" for i, why in enumerate(earlier, 1))
    return type(e)(f"{e} (attempt {attempts} of {attempts}; earlier attempts failed: {history})")


class Phase(enum.Enum):
    STARTING = "ranks are checking in"
    RUNNING = "every rank checked in"
    STOPPING = "every rank was told to stop"
    ENDED = "the job is done"


class Attempt:
    """One attempt: its own secret, channel and job, supervised until the job ends."""

    def __init__(self, info: RunInfo, spec: TaskSpec, max_attempts: int, make_job: JobFactory, host: str):
        self.info = info
        self.max_attempts = max_attempts
        self.started = time.monotonic()
        remaining = None if info.timeout is None else info.timeout - info.elapsed()
        #: When this attempt must stop (the run's timeout less what earlier attempts took); None: never.
        self.deadline = None if remaining is None else self.started + remaining
        self.phase = Phase.STARTING
        self.server: DriverServer | None = None
        if spec.driver_address is not None:
            secret = channel.new_secret()
            self.server = DriverServer(secret, spec.size, host, heartbeat_timeout=spec.heartbeat_timeout)
            spec = dataclasses.replace(spec, secret=secret, driver_address=self.server.address)
        else:
            self.phase = Phase.RUNNING  # ranks rendezvous through Spark; nothing tells the driver
        self.spec = spec
        self.events: queue.SimpleQueue[Event] | None = self.server.events if self.server else None
        # The job wakes the loop the moment it ends, through the same queue as the ranks' events.
        try:
            self.job: Job = make_job(spec, (lambda: self.events.put(JobDone())) if self.events else (lambda: None))
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        self.hosts: dict[int, str] = {}
        #: Each barrier task's rank by its partition: ranks are numbered by host, not by partition.
        self.ranks_by_partition: dict[int, int] = {}
        self.failures: dict[int, RankFailure] = {}
        self.disconnected: set[int] = set()
        self.start_seconds: float | None = None
        #: Why this attempt is stopping: the error it raises unless ranks reported a failure.
        self.stopping: SparkTrainError | None = None
        # Ctrl-C (a notebook's stop button) is raised at the top of a turn of the supervision loop,
        # never inside one of its waits (see sparktrain.driver.interrupts).
        self.interrupts = Interrupts((lambda: self.events.put(Interrupted())) if self.events else (lambda: None))
        self.stalls = StallWatch(spec.size, spec.stall_warning, self.hosts,
                                 self.server.request_stacks if self.server else lambda ranks: None)

    # -- the loop ----------------------------------------------------------------------------------
    def supervise(self) -> Any:
        """Start the job and watch it until it ends; return rank 0's value or raise one error."""
        tail = self._output_tail()
        try:
            with self.interrupts:
                self._supervise()
        finally:
            if self.server is not None:
                self.server.close()
            if tail is not None:
                tail.stop()
        return self._outcome()

    def _supervise(self) -> None:
        try:
            self.job.start()
            of = f" (attempt {self.spec.attempt} of {self.max_attempts})" if self.max_attempts > 1 else ""
            log.info("sparktrain: launching %d rank(s) of %s, run %s%s", self.spec.size, self.info.fn_name,
                     self.info.run_id, of)
            while self.phase is not Phase.ENDED:
                self.interrupts.check()
                self._handle(self._next_event(TICK))
                self._step()
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
        if self.spec.log_target is None or self.server is not None:
            return None
        import cloudpickle

        from ..storage.outputlog import DriverTail

        url, options = cloudpickle.loads(self.spec.log_target)
        write = lambda rank, stream, line, at: self.info.write(Output(rank, stream, line, at))  # noqa: E731
        return DriverTail(url, options, self.info.run_id, write).start()

    def _step(self) -> None:
        """The transitions that the clocks and the job decide."""
        if self.job.done():
            if self.phase is not Phase.STOPPING and self.job.error is not None:
                # The Spark job ended under the ranks (cancelled, or a task lost): tell the ranks
                # now, so their processes end at once.
                self._stop("the run's Spark job ended")
            self.phase = Phase.ENDED
        elif self.phase is not Phase.STOPPING:
            report = self.stalls.check(time.monotonic()) if self.phase is Phase.RUNNING else None
            if report:
                log.warning("sparktrain: run %s: %s", self.info.run_id, report)
            why = self._reason_to_stop()
            if why is not None:
                self.stopping, reason = why
                self._stop(reason)

    def _reason_to_stop(self) -> tuple[SparkTrainError, str] | None:
        now = time.monotonic()
        if self.failures:
            error = RankFailedError(self.failures, stall=self.stalls.last_report or "")
            return error, f"rank {error.root_cause.rank} failed"
        if self.phase is Phase.STARTING and now - self.started > self.spec.start_timeout:
            missing = self.server.missing_ranks() if self.server else []
            size = self.spec.size
            return StartTimeoutError(
                f"timed out after {self.spec.start_timeout:.0f} s waiting for rank(s) {missing} to start "
                f"({size - len(missing)} of {size} checked in). Each rank needs one task slot at the "
                "same time; check the Spark UI for stuck tasks, or raise start_timeout"), "start_timeout expired"
        if self.deadline is not None and now > self.deadline:
            stall = f"\n\nThe last stall report before the timeout:\n{self.stalls.last_report}" \
                if self.stalls.last_report else ""
            return RunTimeoutError(
                f"run {self.info.run_id} of {self.info.fn_name} took longer than timeout={self.info.timeout:g} s and "
                f"was stopped; raise timeout or pass timeout=None for no limit{stall}"), "timeout expired"
        return None

    def _next_event(self, timeout: float) -> Event | None:
        if self.events is None:
            self.job.wait(timeout)
            return None
        try:
            return self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, event: Event | None) -> None:
        """Every event the server or the job produces is handled here."""
        if isinstance(event, Output):
            self.info.write(event)
        elif isinstance(event, Failed):
            self.failures.setdefault(event.failure.rank, event.failure)
        elif isinstance(event, Hello):
            self.hosts[event.rank] = event.host
            self.ranks_by_partition[event.partition] = event.rank
            if self.phase is Phase.STARTING and len(self.hosts) == self.spec.size:
                self.phase = Phase.RUNNING
                self.start_seconds = time.monotonic() - self.started
                log.info("sparktrain: all %d rank(s) started in %.2f s on %s", self.spec.size, self.start_seconds,
                         placement(self.hosts))
        elif isinstance(event, Progress):
            self.stalls.progress(event.rank, event.at, event.time)
        elif isinstance(event, Stacks):
            self.stalls.stacks(event.rank, event.text)
        elif isinstance(event, Closed):
            self.disconnected.add(event.rank)
        elif isinstance(event, Refused):
            log.warning("sparktrain: refused a connection from %s (%s)", event.peer, event.reason)
        elif isinstance(event, (JobDone, Interrupted)) or event is None:
            pass  # _step looks at the job itself

    def _print_stacks(self) -> None:
        """Every running rank's Python stacks, printed where the run prints (on an interrupt)."""
        if self.server is None or self.phase is not Phase.RUNNING:
            return

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
        if self.events is None:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        while True:
            waiting = set(self.hosts) - self.disconnected - self.server.unreachable()
            event = self._next_event(deadline - time.monotonic() if waiting else 0)
            if event is None:
                return
            self._handle(event)
            self.interrupts.check()

    def _stop(self, reason: str) -> None:
        """Stop every rank: ask them (they terminate their process groups), then cancel the job."""
        self.phase = Phase.STOPPING
        if self.server is not None:
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
        if self.failures:
            raise RankFailedError(self.failures, stall=self.stalls.last_report or "")
        if self.stopping is not None:
            raise self.stopping
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
        started = (f"ranks started in {self.start_seconds:.2f} s" if self.start_seconds is not None
                   else "ranks rendezvoused through Spark")
        log.info("sparktrain: run %s of %s finished in %.2f s (%s); rank 0 returned %s", self.info.run_id,
                 self.info.fn_name, self.info.elapsed(), started, returned)
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
        rank = self.ranks_by_partition.get(failure.partition) if failure.partition is not None else None
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


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
