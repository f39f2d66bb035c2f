"""The supervision of one attempt, as pure policy: states that carry their data, and a step
function from ``(state, event, now)`` to ``(state, actions)``. What the run does between attempts
is its size policy's (``sparktrain.driver.supervise.policies``).

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
