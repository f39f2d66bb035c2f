"""An elastic run's size policy on the driver: how large each attempt of ``run_elastic`` is, and
what the driver watches while it runs.

Each attempt is one barrier stage of as many ranks as the cluster has slots for then, between
``min_num_proc`` and ``max_num_proc`` (:func:`sizes`, Horovod's defaults). When an attempt fails
because a rank or a host was lost, the next one starts with the slots there are now, waiting up to
``elastic_timeout`` for at least ``min_num_proc``, and ``hvd.elastic.run`` resumes it from the last
``state.commit()``, which rank 0 wrote under the ``elastic_url`` setting, in the run's id. While an
attempt runs, the loop that supervises it looks at the view's slots once a second
(:class:`Lookout`, on that loop's own thread); once more have lasted ``elastic_grow_after``
seconds, or at once when an executor under the run is being decommissioned
(``spark.decommission.enabled``), the core decides a resize (``supervision.resize``) and this
module leaves the attempt's marker before the loop counts the resize as asked for, at which the
ranks end the attempt at their next commit (``HostsUpdatedInterrupt``; ``CommitStateCallback``
commits at the end of that step), so the next one starts at the new size. ``run_elastic`` itself
is the pipeline of ``sparktrain.driver.run``, with :class:`ElasticPlan` its plan.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from ... import settings
from ...seam import worker_env
from ...errors import InsufficientResourcesError, InvalidArgumentError, UnsupportedError
from ..launch import cluster, config, views
from . import resume
from . import supervision as core
from .attempts import Sized
from ..launch.config import RunConfig

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


def plan(num_proc, min_num_proc, max_num_proc, elastic_timeout, reset_limit,
         run_kwargs: Mapping[str, object]) -> "ElasticPlan":
    """``run_elastic``'s own arguments, checked before anything else, as its plan."""
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
    return ElasticPlan(num_proc, min_num_proc, max_num_proc, timeout, reset_limit)


class ElasticPlan:
    """``run_elastic``'s plan (an ``attempts.Plan``): the active classic session's view, found before
    the arguments are checked; before the run's lease, the ``elastic_url`` setting and the sizes
    from the slots, checked; then :class:`ElasticSize`."""

    def __init__(self, num_proc, min_num_proc, max_num_proc, timeout: float, reset_limit: int | None):
        self.sizes, self.timeout, self.reset_limit = (num_proc, min_num_proc, max_num_proc), timeout, reset_limit

    def session(self) -> views.ClusterView:
        spark = cluster.active_session()
        view = views.of(spark) if spark is not None else None
        if view is None or not view.lists_executors:
            raise UnsupportedError("run_elastic needs an active classic SparkSession (SparkSession.builder...getOrCreate()); "
                                   "it counts the cluster's slots through the SparkContext, which Spark Connect does not "
                                   "have")
        return view

    def checked(self, cfg: RunConfig, view: views.ClusterView) -> Callable[[], Sized]:
        elastic_url, grow_after = config.elastic_settings(cfg)
        if not elastic_url:
            raise InvalidArgumentError(
                "run_elastic resumes each attempt from the last state.commit(), which needs a place every attempt can "
                "read: set the elastic_url setting to an fsspec URL, e.g. env={'SPARKTRAIN_ELASTIC_URL': "
                "'abfss://container@account.dfs.core.windows.net/elastic'} (or the driver's SPARKTRAIN_ELASTIC_URL, or "
                "spark.sparktrain.elasticUrl)")
        profile = view.profile(cfg.stage) if cfg.stage is not None else None
        slots = view.slots(cfg.use_gpu, cfg.stage, profile)
        low, first, high = sizes(*self.sizes, slots)
        if cluster.is_local(view.master) and low > slots:
            raise InsufficientResourcesError(
                f"min_num_proc={low} ranks cannot run at once: the local master {view.master} has {slots} task "
                "slot(s). Lower min_num_proc, or use a master with more slots")
        policy = core.Elastic(low, first, high, self.reset_limit, self.timeout, grow_after)
        # The elastic id, under which the commits and the resize markers go, is the run's name, else its id.
        sized = Sized(policy, ElasticSize(view, cfg, profile, policy, elastic_url), profile, high,
                      {worker_env.ELASTIC_ID: resume.home_id(cfg)})
        return lambda: sized


class ElasticSize:
    """``run_elastic``'s attempts (an ``attempts.Sizer``): each as large as the slots allow, between
    the policy's bounds, waiting for them; while one runs, what its loop looks at, and the resize marker
    that leaves; the attempt's number in its ranks' environment (the marker's name)."""

    def __init__(self, view: views.ClusterView, cfg: RunConfig, profile, policy: core.Elastic, elastic_url: str):
        self.view, self.cfg, self.profile, self.policy = view, cfg, profile, policy
        self.url, self.run_id = elastic_url, resume.home_id(cfg)
        self.storage_options = cfg.args.storage_options

    def slots(self) -> int:
        return self.view.slots(self.cfg.use_gpu, self.cfg.stage, self.profile)

    def size(self, number: int, retry: core.Retry | None) -> int:
        if retry is None:
            want, reason = self.policy.first, ""
        else:
            if not retry.resized:
                self._settle()
            want, reason = retry.size or self.policy.high, retry.why + self._last_commit()
        while True:
            size = self._wait(want, reason)
            try:  # the slots may go between the count and the launch
                return self.view.fit(size, self.cfg.use_gpu, self.cfg.stage, self.profile, self.cfg.capacity_wait)
            except InsufficientResourcesError as e:
                want, reason = self.policy.low, f"the slots went while it launched ({e})"

    def _wait(self, want: int, reason: str) -> int:
        """As many ranks as there are slots for, between the least and ``min(want, most)``; waits up
        to ``elastic_timeout`` for the least. Logs the change in one line when ``reason`` says why."""
        low, timeout = self.policy.low, self.policy.timeout
        slots = self.view.wait_for_slots(low, self.cfg.use_gpu, timeout, self.cfg.stage, self.profile)
        if slots < low:
            raise InsufficientResourcesError(
                f"run_elastic waited {timeout:g} s for at least min_num_proc={low} slot(s); the cluster has {slots}"
                + (f" ({reason})" if reason else "") + ". Add executors, or lower min_num_proc")
        size = min(slots, want, self.policy.high)
        if reason:
            log.warning("sparktrain: %s; continuing with %d rank(s)", reason, size)
        return size

    def _settle(self, quiet: float = 3.0, wait: float = 20.0) -> None:
        """Let Spark notice what the failure did: wait until the slot count has not changed for
        ``quiet`` seconds (at most ``wait``), so the next attempt is not sized by a lost executor.
        A local master's slots never change."""
        if cluster.is_local(self.view.master):
            return
        deadline = time.monotonic() + wait
        last, since = self.slots(), time.monotonic()
        while time.monotonic() - since < quiet and time.monotonic() < deadline:
            time.sleep(0.5)  # executors go with no event the driver's Python side can await
            now = self.slots()
            if now != last:
                last, since = now, time.monotonic()

    def _last_commit(self) -> str:
        """Where the next attempt resumes, as the commit's manifest tells it."""
        try:
            meta = self._home().last_commit()
        except Exception:  # noqa: BLE001 - the store is unreachable from here
            meta = None
        if meta is None:
            return "; no commit yet: the next attempt starts from the beginning"
        epoch, batch = meta.get("epoch"), meta.get("batch")
        where = f", at epoch {epoch}" if epoch is not None else ""
        return "; the next attempt resumes from the last commit" + where + (f", batch {batch}" if where and batch else "")

    def watch(self, number: int, size: int) -> "Lookout":
        return Lookout(self.slots, self.view.decommissioning_hosts, size, self.policy,
                       lambda resize: self._mark(number, resize))

    def _mark(self, number: int, resize: core.Resize) -> None:
        """Leave attempt ``number``'s resize marker, where its rank 0 looks (``tensorflow.resize``)."""
        self._home().mark_resize(number, resize.why)
        log.info("sparktrain: %s: the ranks end this attempt at their next commit, and the next one starts with "
                 "%d rank(s)", resize.why, resize.size)

    def env(self, number: int) -> Mapping[str, str]:
        return {worker_env.ELASTIC_ATTEMPT: str(number)}

    def _home(self):
        from ...storage.home import Home

        return Home(self.url, self.run_id, self.storage_options)


class Lookout:
    """While an attempt of ``size`` ranks runs, on the turns of the attempt's loop
    (``attempt.Attempt``), every :data:`POLL_SECONDS`: the slots, and the hosts leaving when there
    are fewer than ranks, into the core's ``resize``. When it decides one, ``mark`` leaves the
    marker, and only then :attr:`resize` says what was asked. At most once per attempt."""

    def __init__(self, slots: Callable[[], int], leaving: Callable[[], list[str]], size: int, policy: core.Elastic,
                 mark: Callable[[core.Resize], None], clock: Callable[[], float] = time.monotonic):
        self.slots, self.leaving, self.size, self.policy, self.mark = slots, leaving, size, policy, mark
        self.clock = clock
        self.resize: core.Resize | None = None
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
        decided = core.resize(slots, leaving, self.size, self.policy.high, self._since, self.clock(),
                              self.policy.grow_after)
        if isinstance(decided, core.Watch):
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
