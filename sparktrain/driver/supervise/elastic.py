"""An elastic run on the driver (``run_elastic``): its policy from the slots, and the I/O its
decisions need while the run's loop (``attempts``) carries them out.

Each attempt is one barrier stage of as many ranks as the cluster has slots for then, between
``min_num_proc`` and ``max_num_proc`` (:func:`sizes`, Horovod's defaults). When an attempt fails
because a rank or a host was lost, the next one starts with the slots there are now, waiting up to
``elastic_timeout`` for at least ``min_num_proc``, and ``hvd.elastic.run`` resumes it from the last
``state.commit()``, which rank 0 wrote in the run's home. While an attempt runs, the loop that
supervises it looks at the slots once a second (:class:`Lookout`, on that loop's own thread); once
more have lasted ``elastic_grow_after`` seconds, or at once when an executor under the run is being
decommissioned (``spark.decommission.enabled``), the policy decides a resize
(``policies.Elastic.look``) and :func:`mark` leaves the attempt's marker in the home before the
loop counts the resize as asked for, at which the ranks end the attempt at their next commit
(``HostsUpdatedInterrupt``; ``CommitStateCallback`` commits at the end of that step), so the next
one starts at the new size.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping

from ... import settings
from ...errors import InsufficientResourcesError, InvalidArgumentError, UnsupportedError
from . import policies

if TYPE_CHECKING:
    from ..launch.prepare import Launch

log = logging.getLogger("sparktrain")

#: Horovod's default for how long to wait for enough slots.
ELASTIC_TIMEOUT = 600.0
#: Seconds between the looks at the slots while an attempt runs (:class:`Lookout`).
POLL_SECONDS = 1.0


def check_sizes(num_proc, min_num_proc, max_num_proc) -> None:
    """Each size a positive int, or None."""
    for name, value in (("num_proc", num_proc), ("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name} must be a positive int or None, got {value!r}")


def sizes(num_proc, min_num_proc, max_num_proc, slots: int) -> tuple[int, int, int]:
    """``(min, first, max)`` ranks, checked; Horovod's defaults."""
    check_sizes(num_proc, min_num_proc, max_num_proc)
    first = num_proc or max_num_proc or max(1, slots)
    low = min_num_proc or first
    high = max_num_proc or max(first, low)
    if not low <= first <= high:
        raise InvalidArgumentError(f"run_elastic needs min_num_proc <= num_proc <= max_num_proc, got {low} <= {first} <= "
                                   f"{high}")
    return low, first, high


def check_arguments(num_proc, min_num_proc, max_num_proc, elastic_timeout, reset_limit,
                    run_kwargs: Mapping[str, object]) -> tuple[float, int | None]:
    """``run_elastic``'s own arguments, checked before anything else: ``(elastic_timeout, reset_limit)``."""
    if "max_attempts" in run_kwargs:
        raise InvalidArgumentError("run_elastic does not take max_attempts: it restarts as long as at least min_num_proc "
                                   "ranks can run; bound the restarts with reset_limit=")
    if run_kwargs.get("local_mode") or (isinstance(num_proc, int) and num_proc < 0):
        raise InvalidArgumentError("run_elastic runs on a Spark cluster; local mode has no executors to lose")
    check_sizes(num_proc, min_num_proc, max_num_proc)
    timeout = settings.parse_seconds("elastic_timeout", elastic_timeout if elastic_timeout is not None
                                     else ELASTIC_TIMEOUT)
    if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int) or reset_limit < 0):
        raise InvalidArgumentError(f"reset_limit must be a non-negative int or None, got {reset_limit!r}")
    return timeout, reset_limit


def check_view(lists_executors: bool) -> None:
    """``run_elastic`` counts the slots through the SparkContext, which Spark Connect does not have."""
    if not lists_executors:
        raise UnsupportedError("run_elastic needs an active classic SparkSession (SparkSession.builder...getOrCreate()); "
                               "it counts the cluster's slots through the SparkContext, which Spark Connect does not "
                               "have")


def policy(launch: "Launch", num_proc, min_num_proc, max_num_proc, timeout: float,
           reset_limit: int | None) -> policies.Elastic:
    """The elastic run's policy, its sizes from the slots there are now; refuses a run without an
    ``elastic_url``, and more ranks at the least than a local master has slots."""
    if launch.home is None:
        raise InvalidArgumentError(
            "run_elastic resumes each attempt from the last state.commit(), which needs a place every attempt can "
            "read: set the elastic_url setting to an fsspec URL, e.g. env={'SPARKTRAIN_ELASTIC_URL': "
            "'abfss://container@account.dfs.core.windows.net/elastic'} (or the driver's SPARKTRAIN_ELASTIC_URL, or "
            "spark.sparktrain.elasticUrl)")
    slots = launch.slots()
    low, first, high = sizes(num_proc, min_num_proc, max_num_proc, slots)
    if launch.local_master and low > slots:
        raise InsufficientResourcesError(
            f"min_num_proc={low} ranks cannot run at once: the local master {launch.view.master} has {slots} task "
            "slot(s). Lower min_num_proc, or use a master with more slots")
    return policies.Elastic(low, first, high, reset_limit, timeout, launch.cfg.settings.elastic_grow_after,
                            launch.cfg.capacity_wait)


def wait_for(launch: "Launch", start: policies.Start, want: int, why: str) -> int:
    """As many ranks as there are slots for, between ``start.low`` and ``want``; waits up to
    ``start.wait`` seconds for the least. Logs the change in one line when ``why`` says why."""
    low, timeout = start.low, start.wait
    slots = launch.wait_for_slots(low, timeout)
    if slots < low:
        raise InsufficientResourcesError(
            f"run_elastic waited {timeout:g} s for at least min_num_proc={low} slot(s); the cluster has {slots}"
            + (f" ({why})" if why else "") + ". Add executors, or lower min_num_proc")
    size = min(slots, want)
    if why:
        log.warning("sparktrain: %s; continuing with %d rank(s)", why, size)
    return size


def settle(launch: "Launch", quiet: float = 3.0, wait: float = 20.0) -> None:
    """Let Spark notice what a failure did: wait until the slot count has not changed for
    ``quiet`` seconds (at most ``wait``), so the next attempt is not sized by a lost executor.
    A local master's slots never change."""
    if launch.local_master:
        return
    deadline = time.monotonic() + wait
    last, since = launch.slots(), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.5)  # executors go with no event the driver's Python side can await
        now = launch.slots()
        if now != last:
            last, since = now, time.monotonic()


def resumes_from(home) -> str:
    """Where the next attempt resumes, as the last commit in ``home`` tells it."""
    try:
        commit = home.last_commit() if home is not None else None
    except Exception:  # noqa: BLE001 - the store is unreachable from here
        commit = None
    if commit is None:
        return "; no commit yet: the next attempt starts from the beginning"
    epoch, batch = commit.get("epoch"), commit.get("batch")
    where = f", at epoch {epoch}" if epoch is not None else ""
    return "; the next attempt resumes from the last commit" + where + (f", batch {batch}" if where and batch else "")


def mark(home, number: int, resize: policies.Resize) -> None:
    """Leave attempt ``number``'s resize marker in ``home``, where its rank 0 looks (``tensorflow.resize``)."""
    home.mark_resize(number, resize.why)
    log.info("sparktrain: %s: the ranks end this attempt at their next commit, and the next one starts with "
             "%d rank(s)", resize.why, resize.size)


class Lookout:
    """While an attempt of ``size`` ranks runs, on the turns of the attempt's loop
    (``attempt.Attempt``), every :data:`POLL_SECONDS`: the slots, and the hosts leaving when there
    are fewer than ranks, into the policy's ``look``. When it decides a resize, ``mark`` leaves the
    marker, and only then :attr:`resize` says what was asked. At most once per attempt."""

    def __init__(self, slots: Callable[[], int], leaving: Callable[[], list[str]], size: int,
                 policy: policies.Elastic, mark: Callable[[policies.Resize], None],
                 clock: Callable[[], float] = time.monotonic):
        self.slots, self.leaving, self.size, self.policy, self.mark = slots, leaving, size, policy, mark
        self.clock = clock
        self.resize: policies.Resize | None = None
        self._next = clock() + POLL_SECONDS  # the first look a poll's time after the attempt's start
        self._since: float | None = None
        self._done = False

    def look(self) -> None:
        """One look, when its time has come; the next a poll's time after this one ends."""
        if self._done or self.clock() < self._next:
            return
        try:
            self._look()
        finally:
            self._next = self.clock() + POLL_SECONDS

    def _look(self) -> None:
        try:
            slots = self.slots()
            leaving = self.leaving() if slots < self.size else []
        except Exception:  # noqa: BLE001 - a Py4J call failed (seen: a reset); look again
            self._since = None
            return
        decided = self.policy.look(slots, leaving, self.size, self._since, self.clock())
        if isinstance(decided, policies.Keep):
            self._since = decided.since
            return
        self._done = True
        try:
            self.mark(decided)
        except Exception as e:  # noqa: BLE001 - the attempt goes on at its size; nothing was asked of its ranks
            log.warning("sparktrain: %s, but the resize marker could not be written (%s: %s); this attempt goes on "
                        "with %d rank(s)", decided.why, type(e).__name__, str(e)[:200], self.size)
            return
        self.resize = decided
