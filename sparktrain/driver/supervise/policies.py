"""A run's size policy, one of two values: :class:`Fixed` (``run``) or :class:`Elastic`
(``run_elastic``). The run's loop (``sparktrain.driver.supervise.attempts.supervise``) asks it and
carries out what it decides:

- before each attempt, :meth:`start`: a :class:`Start`, the ranks to ask for, the fewest to
  accept and how long to wait for their slots;
- while an attempt runs (an elastic policy ``watches``), :meth:`look` at the slots: :class:`Keep`
  watching, or :class:`Resize` the attempt at its ranks' next commit;
- after an attempt failed, :meth:`after_failure`: :class:`Retry` at a size, or :class:`GiveUp`
  with the error the run raises.

Nothing here reads a clock, a socket or Spark.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from ...errors import RankFailedError, SparkTrainError
from ...seam import worker_env

#: Seconds a retry waits at most for the cluster to offer every slot again (a lost executor's
#: replacement registers within seconds on standalone, YARN and Kubernetes).
RETRY_CAPACITY_WAIT = 60.0


@dataclasses.dataclass(frozen=True)
class Start:
    """The next attempt: ``want`` ranks (None: every slot), no fewer than ``low``, waiting up to
    ``wait`` seconds for their slots. ``exact``: ``want`` ranks or none (a fixed gang); otherwise
    as many as there are slots for, between ``low`` and ``want``. ``why``: what the last attempt
    ended for, for the driver's line; ``settle``: let Spark notice a loss before the slots are counted."""

    want: int | None
    low: int
    wait: float
    exact: bool
    why: str = ""
    settle: bool = False


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


@dataclasses.dataclass(frozen=True)
class Resize:
    """End the running attempt at the ranks' next commit; the next one has ``size`` ranks, because of ``why``."""

    size: int
    why: str


@dataclasses.dataclass(frozen=True)
class Keep:
    """Keep watching; ``since``: when the slots for more ranks appeared (None: there are none)."""

    since: float | None = None


Decision = Union[Retry, GiveUp]


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A gang of ``num_proc`` ranks (None: every slot, counted once), started up to ``max_attempts``
    times, waiting ``capacity_wait`` seconds for its slots (``run``)."""

    num_proc: int | None
    max_attempts: int
    capacity_wait: float = 0.0
    #: A fixed gang never looks at the slots while it runs.
    watches = False

    @property
    def attempts(self) -> int:
        """How many attempts the run may have in all (the ranks' ``SPARKTRAIN_MAX_ATTEMPTS``)."""
        return self.max_attempts

    def most(self, first: int) -> int:
        """The most ranks an attempt has, once the first has ``first``."""
        return first

    def start(self, retry: Retry | None, last: int | None) -> Start:
        """The first attempt's ``num_proc``; a retry's all ``last`` ranks again, once their slots are back."""
        if retry is None:
            return Start(self.num_proc, self.num_proc or 1, self.capacity_wait, exact=True)
        return Start(last, last, max(RETRY_CAPACITY_WAIT, self.capacity_wait), exact=True, why=retry.why)

    def env(self, number: int) -> Mapping[str, str]:
        return {}

    def after_failure(self, error: SparkTrainError, number: int, out_of_time: bool, earlier: list[str],
                      resize: Resize | None = None) -> Decision:
        """All ranks again, while attempts are left and the error could pass (:func:`retry`)."""
        if retry(error, number, self.max_attempts, out_of_time):
            return Retry(None, first_line(str(error)))
        return GiveUp(error if number == 1 else with_attempts(error, number, list(earlier)))


@dataclasses.dataclass(frozen=True)
class Elastic:
    """As many ranks as the cluster has slots for, from ``low`` to ``high``, the first attempt
    ``first`` (``run_elastic``): ``reset_limit`` restarts at most (None: no bound), each waiting up
    to ``timeout`` seconds for ``low`` slots; free slots for more ranks must last ``grow_after``.
    ``capacity_wait``: how long the launch of a counted size waits for its executors."""

    low: int
    first: int
    high: int
    reset_limit: int | None
    timeout: float
    grow_after: float
    capacity_wait: float = 0.0
    #: An elastic attempt's loop looks at the slots (:meth:`look`).
    watches = True

    @property
    def attempts(self) -> int:
        """How many attempts the run may have in all; 0: no bound."""
        return 0 if self.reset_limit is None else self.reset_limit + 1

    def most(self, first: int) -> int:
        return self.high

    def start(self, retry: Retry | None, last: int | None) -> Start:
        """The first attempt's ``first`` ranks; after a resize, the size it asked for; after a loss,
        as many as the slots allow, once Spark has noticed the loss."""
        if retry is None:
            return Start(self.first, self.low, self.timeout, exact=False)
        return Start(min(retry.size or self.high, self.high), self.low, self.timeout, exact=False, why=retry.why,
                     settle=not retry.resized)

    def env(self, number: int) -> Mapping[str, str]:
        """Attempt ``number``'s ranks find its number: the name of its resize marker."""
        return {worker_env.ELASTIC_ATTEMPT: str(number)}

    def look(self, slots: int, leaving: list[str], size: int, since: float | None, now: float) -> Resize | Keep:
        """:func:`resize`, for an attempt of ``size`` ranks under this policy."""
        return resize(slots, leaving, size, self.high, since, now, self.grow_after)

    def after_failure(self, error: SparkTrainError, number: int, out_of_time: bool, earlier: list[str],
                      resize: Resize | None = None) -> Decision:
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


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


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


def resize(slots: int, leaving: list[str], size: int, high: int, since: float | None, now: float,
           grow_after: float) -> Resize | Keep:
    """What the driver asks of an elastic attempt of ``size`` ranks (at most ``high``) when the
    cluster has ``slots`` and the executors on ``leaving`` hosts are being decommissioned, at
    monotonic ``now``; ``since``: when slots for more ranks appeared, as the last :class:`Keep` said.

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
            return Keep(since)
        grown = min(slots, high)
        return Resize(grown, f"the cluster has slots for {grown} rank(s)")
    return Keep()
