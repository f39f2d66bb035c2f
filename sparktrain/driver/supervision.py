"""The supervision of one attempt, as pure policy: states that carry their data, and a step
function from ``(state, event, now)`` to ``(state, actions)``; and the retry policy of a run.

Nothing here reads a clock, a socket or Spark: ``sparktrain.driver.attempt`` feeds it the
events of the run's channel and job with the time, and carries out the actions it returns.
The states::

    Starting --every rank checked in--> Running
    Starting/Running --a rank failed, a timeout, the job ended under the ranks--> Stopping
    any --the job is done--> Ended
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from ..errors import RankFailedError, RankFailure, RunTimeoutError, SparkTrainError, StartTimeoutError
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
    rank: int
    host: str
    partition: int = -1


@dataclasses.dataclass(frozen=True)
class RankFailed:
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


# -- an elastic run's attempts --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Restart:
    """How an elastic run goes on after a failed attempt: at ``size`` ranks (None: as many slots as
    there are, up to the most), because of a resize (``resized``) or a loss."""

    size: int | None
    resized: bool


#: Exceptions a rank raises when a peer goes away: the native engine's, and TensorFlow's.
PEER_ERRORS = ("CollectiveError", "UnavailableError", "AbortedError", "DeadlineExceededError", "InternalError")


def lost_ranks(error: SparkTrainError) -> bool:
    """Whether a rank or host was lost (a restart can help), not only exceptions of ``train_fn``'s own.

    A rank that exited without an exception, a task Spark lost, an unreachable host, or a
    collective that failed because a peer went away: Horovod's ``HorovodInternalError``."""
    if not isinstance(error, RankFailedError):
        return error.retryable
    return any(not f.traceback or f.exc_type.rsplit(".", 1)[-1] in PEER_ERRORS for f in error.failures.values())


def elastic_restart(error: SparkTrainError, resized_to: int | None, resets: int,
                    reset_limit: int | None) -> Restart:
    """What an elastic run does after attempt ``error``, its ``resets``-th restart: raise ``error``
    when a restart cannot help (``train_fn``'s own exception), raise when ``reset_limit`` is spent,
    else restart: at ``resized_to`` ranks when the ranks ended the attempt for a resize, or with
    the slots there are after a loss."""
    resized = bool(resized_to) and isinstance(error, RankFailedError) and bool(error.failures) and \
        error.root_cause.exc_type.endswith("HostsUpdatedInterrupt")
    if not resized and not lost_ranks(error):
        raise error  # it would fail the same way again
    if reset_limit is not None and resets > reset_limit:
        raise SparkTrainError(f"run_elastic gave up after reset_limit={reset_limit} restart(s); the last attempt "
                              f"failed: {error}") from error
    return Restart(resized_to if resized else None, resized)
