"""The supervision of one attempt, as pure policy: states that carry their data, and a step
function from ``(state, event, now)`` to ``(state, actions)``; and the run's policy between
attempts, for fixed and elastic runs alike: after a failed attempt, the run's size policy
(:class:`Fixed` or :class:`Elastic`, each a value) decides (:func:`after_failure`: :class:`Retry` at a
size, or :class:`GiveUp` with the error), and while an elastic attempt runs,
:func:`resize` decides from the slots whether to ask its ranks for a new size.

Nothing here reads a clock, a socket or Spark: ``sparktrain.driver.supervise.attempt`` feeds it the
events of the run's channel and job with the time, and carries out the actions it returns.
The states::

    Starting --every rank checked in--> Running
    Starting/Running --a rank failed, a timeout, the job ended under the ranks--> Stopping
    any --the job is done--> Ended
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from ...errors import RankFailedError, RankFailure, RunTimeoutError, SparkTrainError, StartTimeoutError
from .growing import Growing


# -- what it knows ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Limits:
    """What one attempt may take: its ranks, and its clocks (monotonic seconds)."""

    size: int
    #: When the attempt started.
    started: float
    #: Seconds every rank has to check in.
    start_timeout: float
    #: When the attempt must stop (the run's timeout, less what earlier attempts took); None: never.
    deadline: float | None = None
    #: Words for the run's timeout error: ``run <id> of <fn>``, and the timeout itself.
    run: str = "the run"
    timeout: float | None = None


def _empty() -> Mapping:
    return Growing()


def _grown(mapping: Mapping) -> Growing:
    return mapping if isinstance(mapping, Growing) else Growing(mapping)


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the ranks said so far: where each checked in, and their failure reports."""

    hosts: Mapping[int, str] = dataclasses.field(default_factory=_empty)
    #: Each barrier task's rank by its partition: ranks are numbered by host, not by partition.
    partitions: Mapping[int, int] = dataclasses.field(default_factory=_empty)
    failures: Mapping[int, RankFailure] = dataclasses.field(default_factory=_empty)

    def hello(self, rank: int, host: str, partition: int) -> "Seen":
        # O(1) each (growing.py): a copy of every rank's entry at each check-in was quadratic in ranks.
        return dataclasses.replace(self, hosts=_grown(self.hosts).plus(rank, host),
                                   partitions=_grown(self.partitions).plus(partition, rank))

    def failed(self, failure: RankFailure) -> "Seen":
        if failure.rank in self.failures:
            return self  # a rank's first report is its root cause
        return dataclasses.replace(self, failures=_grown(self.failures).plus(failure.rank, failure))


@dataclasses.dataclass(frozen=True)
class Starting:
    seen: Seen = dataclasses.field(default_factory=Seen)


@dataclasses.dataclass(frozen=True)
class Running:
    seen: Seen
    #: Seconds from the attempt's start until every rank had checked in; None where ranks meet
    #: through Spark and nothing tells the driver.
    start_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Stopping:
    seen: Seen
    #: Why, when nothing the ranks reported says more: the error the attempt raises.
    error: SparkTrainError | None
    reason: str


@dataclasses.dataclass(frozen=True)
class Ended:
    seen: Seen
    error: SparkTrainError | None = None
    start_seconds: float | None = None


State = Union[Starting, Running, Stopping, Ended]


# -- what it hears ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckedIn:
    """A rank checked in from ``host``, from the barrier task of ``partition`` (-1 in local mode):
    the channel's event for the rank's ``protocol.CheckedIn`` message."""

    rank: int
    host: str
    partition: int = -1


@dataclasses.dataclass(frozen=True)
class RankFailed:
    """A rank's failure report: its task's ``protocol.RankFailed`` message, or the driver's own for a
    rank found unreachable."""

    failure: RankFailure


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """The job is done; ``failed``: it ended with an error (cancelled, a task lost, a rank failed)."""

    failed: bool


#: None is the clock's tick: only the time changed.
Event = Union[CheckedIn, RankFailed, JobEnded, None]


# -- what it asks for ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Started:
    """Every rank checked in, ``seconds`` after the attempt started."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop every rank: tell them ``reason``, wait for them to go, then cancel the job."""

    reason: str


Action = Union[Started, Stop]


def step(state: State, event: Event, now: float, limits: Limits) -> tuple[State, list[Action]]:
    """The attempt's next state, and what to do, after ``event`` at monotonic ``now``."""
    seen = state.seen
    if isinstance(event, CheckedIn):
        seen = seen.hello(event.rank, event.host, event.partition)
    elif isinstance(event, RankFailed):
        seen = seen.failed(event.failure)
    state = dataclasses.replace(state, seen=seen)
    if isinstance(state, Ended):
        return state, []  # what the ranks said last (their failure reports) still counts
    if isinstance(event, JobEnded):
        if event.failed and not isinstance(state, Stopping):
            # The job ended under the ranks (cancelled, or a task lost): tell them now, so their
            # processes end at once.
            return Ended(seen, start_seconds=_start_seconds(state)), [Stop("the run's Spark job ended")]
        return Ended(seen, state.error if isinstance(state, Stopping) else None, _start_seconds(state)), []
    if isinstance(state, Stopping):
        return state, []
    actions: list[Action] = []
    if isinstance(state, Starting) and len(seen.hosts) == limits.size:
        state = Running(seen, now - limits.started)
        actions.append(Started(state.start_seconds))
    why = reason_to_stop(state, now, limits)
    if why is not None:
        error, reason = why
        return Stopping(seen, error, reason), actions + [Stop(reason)]
    return state, actions


def _start_seconds(state: State) -> float | None:
    return state.start_seconds if isinstance(state, Running) else None


def reason_to_stop(state: Starting | Running, now: float, limits: Limits) -> tuple[SparkTrainError | None, str] | None:
    """Why the attempt must stop now (the error it raises and the words the ranks are told), or None."""
    seen = state.seen
    if seen.failures:
        return None, f"rank {RankFailedError(seen.failures).root_cause.rank} failed"
    if isinstance(state, Starting) and now - limits.started > limits.start_timeout:
        missing = [r for r in range(limits.size) if r not in seen.hosts]
        return StartTimeoutError(
            f"timed out after {limits.start_timeout:.0f} s waiting for rank(s) {missing} to start "
            f"({limits.size - len(missing)} of {limits.size} checked in). Each rank needs one task slot at the "
            "same time; check the Spark UI for stuck tasks, or raise start_timeout"), "start_timeout expired"
    if limits.deadline is not None and now > limits.deadline:
        return RunTimeoutError(
            f"{limits.run} took longer than timeout={limits.timeout:g} s and was stopped; raise timeout or pass "
            "timeout=None for no limit"), "timeout expired"
    return None


# -- the run's attempts -------------------------------------------------------------------------
#
# After a failed attempt the core decides, as a value, what the run does: :class:`Retry` at a size,
# or :class:`GiveUp` with the error the run raises. ``sparktrain.driver.supervise.attempts`` carries it out.

@dataclasses.dataclass(frozen=True)
class Fixed:
    """A gang of ``size`` ranks, started up to ``max_attempts`` times (``run``)."""

    size: int
    max_attempts: int

    @property
    def attempts(self) -> int:
        """How many attempts the run may have in all (the ranks' ``SPARKTRAIN_MAX_ATTEMPTS``)."""
        return self.max_attempts

    @property
    def known_size(self) -> int:
        """The size of every attempt, known before the first."""
        return self.size

    def after_failure(self, error: SparkTrainError, number: int, out_of_time: bool, earlier: list[str],
                      resize: "Resize | None") -> "Decision":
        """All ``size`` ranks again, while attempts are left and the error could pass (:func:`retry`)."""
        if retry(error, number, self.max_attempts, out_of_time):
            return Retry(self.size, first_line(str(error)))
        return GiveUp(error if number == 1 else with_attempts(error, number, list(earlier)))


@dataclasses.dataclass(frozen=True)
class Elastic:
    """As many ranks as the cluster has slots for, from ``low`` to ``high``, the first attempt
    ``first`` (``run_elastic``): ``reset_limit`` restarts at most (None: no bound), each waiting up
    to ``timeout`` seconds for ``low`` slots; free slots for more ranks must last ``grow_after``."""

    low: int
    first: int
    high: int
    reset_limit: int | None
    timeout: float
    grow_after: float

    @property
    def attempts(self) -> int:
        """How many attempts the run may have in all; 0: no bound."""
        return 0 if self.reset_limit is None else self.reset_limit + 1

    #: The size of every attempt, known before the first: none, the slots decide each.
    known_size = None

    def after_failure(self, error: SparkTrainError, number: int, out_of_time: bool, earlier: list[str],
                      resize: "Resize | None") -> "Decision":
        """Again, at the size asked for (a resize) or the slots allow (a lost rank or host), within
        ``reset_limit``; an exception of ``train_fn``'s own ends the run."""
        resized = resize is not None and isinstance(error, RankFailedError) and bool(error.failures) and \
            error.root_cause.exc_type.endswith("HostsUpdatedInterrupt")
        if out_of_time or (not resized and not lost_ranks(error)):
            return GiveUp(error)  # it would fail the same way again
        if self.reset_limit is not None and number > self.reset_limit:
            return GiveUp(SparkTrainError(f"run_elastic gave up after reset_limit={self.reset_limit} restart(s); the "
                                          f"last attempt failed: {error}"))
        return Retry(resize.size, resize.why, True) if resized else Retry(None, lost(error))


Policy = Union[Fixed, Elastic]


@dataclasses.dataclass(frozen=True)
class Retry:
    """Start the next attempt: at ``size`` ranks (None: as many as there are slots for, up to the
    most), because of ``why``; ``resized``: the ranks ended the attempt for a resize."""

    size: int | None
    why: str
    resized: bool = False


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """End the run with ``error`` (the attempt's own, or one that says more)."""

    error: SparkTrainError


Decision = Union[Retry, GiveUp]


def retry(error: SparkTrainError, number: int, max_attempts: int, out_of_time: bool) -> bool:
    """Whether attempt ``number``'s ``error`` starts the gang again: not on the last attempt, not
    once the run's timeout is spent, and not for what would fail the same way again (a
    cancellation, a timeout, a result too large, a rank's own error of that kind)."""
    return number < max_attempts and not out_of_time and error.retryable


def with_attempts(error: SparkTrainError, attempts: int, earlier: list[str]) -> SparkTrainError:
    """The last attempt's error, saying how many attempts ran and why each earlier one failed."""
    if isinstance(error, RankFailedError):
        return RankFailedError(error.failures, attempts=attempts, earlier=earlier, stall=error.stall)
    history = "; ".join(f"attempt {i}: {why}" for i, why in enumerate(earlier, 1))
    return type(error)(f"{error} (attempt {attempts} of {attempts}; earlier attempts failed: {history})")


def after_failure(policy: Policy, error: SparkTrainError, number: int, out_of_time: bool,
                  earlier: list[str] = (), resize: "Resize | None" = None) -> Decision:
    """What the run does after attempt ``number`` failed with ``error``, as ``policy`` decides it.
    ``earlier``: why each earlier attempt failed; ``resize``: what the driver asked the ranks of an
    elastic attempt for."""
    return policy.after_failure(error, number, out_of_time, list(earlier), resize)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


# -- an elastic run's losses and resizes -------------------------------------------------------------

#: Exceptions a rank raises when a peer goes away: the native engine's, and TensorFlow's.
PEER_ERRORS = ("CollectiveError", "UnavailableError", "AbortedError", "DeadlineExceededError", "InternalError")


def lost_ranks(error: SparkTrainError) -> bool:
    """Whether a rank or host was lost (a restart can help), not only exceptions of ``train_fn``'s own.

    A rank that exited without an exception, a task Spark lost, an unreachable host, or a
    collective that failed because a peer went away: Horovod's ``HorovodInternalError``."""
    if not isinstance(error, RankFailedError):
        return error.retryable
    return any(not f.traceback or f.exc_type.rsplit(".", 1)[-1] in PEER_ERRORS for f in error.failures.values())


def lost(error: SparkTrainError) -> str:
    """Words for what an elastic attempt lost, for the driver's line about the next one."""
    if isinstance(error, RankFailedError) and error.failures:
        root = error.root_cause
        where = f" on host {root.host}" if getattr(root, "host", None) else ""
        return f"rank {root.rank}{where} was lost" + (f" ({root.exc_type})" if root.exc_type else "")
    return f"the attempt failed ({first_line(str(error))[:200]})"


@dataclasses.dataclass(frozen=True)
class Resize:
    """End the running attempt at the ranks' next commit; the next one has ``size`` ranks, because of ``why``."""

    size: int
    why: str


@dataclasses.dataclass(frozen=True)
class Watch:
    """Keep watching; ``since``: when the slots for more ranks appeared (None: there are none)."""

    since: float | None = None


def resize(slots: int, leaving: list[str], size: int, high: int, since: float | None, now: float,
           grow_after: float) -> Resize | Watch:
    """What the driver asks of an elastic attempt of ``size`` ranks (at most ``high``) when the
    cluster has ``slots`` and the executors on ``leaving`` hosts are being decommissioned, at
    monotonic ``now``; ``since``: when slots for more ranks appeared, as the last :class:`Watch` said.

    - fewer slots than ranks while an executor under the run is being decommissioned (Spark no
      longer counts its slots): resize at once, to the slots left;
    - slots for more ranks that have lasted ``grow_after`` seconds: grow, up to ``high``. The
      clock starts at the first look that sees them, so an attempt younger than ``grow_after``
      never grows, and an executor that comes and goes cannot restart the run over and over.
    """
    if slots < size and leaving:
        return Resize(max(1, slots), f"host {', '.join(leaving)} is being decommissioned")
    if slots > size and size < high:
        since = now if since is None else since
        if now - since < grow_after:
            return Watch(since)
        grown = min(slots, high)
        return Resize(grown, f"the cluster has slots for {grown} rank(s)")
    return Watch()
