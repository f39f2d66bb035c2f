"""An elastic run's size policy on the driver: how large each attempt of ``run_elastic`` is, and
what the driver watches while it runs.

Each attempt is one barrier stage of as many ranks as the cluster has slots for then, between
``min_num_proc`` and ``max_num_proc`` (:func:`sizes`, Horovod's defaults). When an attempt fails
because a rank or a host was lost, the next one starts with the slots there are now, waiting up to
``elastic_timeout`` for at least ``min_num_proc``, and ``hvd.elastic.run`` resumes it from the last
``state.commit()``, which rank 0 wrote under the ``elastic_url`` setting, in the run's id. While an
attempt runs, a poller looks at the view's slots; once more have lasted ``elastic_grow_after``
seconds, or at once when an executor under the run is being decommissioned
(``spark.decommission.enabled``), the core decides a resize (``supervision.resize``) and this module
leaves the attempt's marker, at which the ranks end the attempt at their next commit
(``HostsUpdatedInterrupt``; ``CommitStateCallback`` commits at the end of that step), so the next one
starts at the new size. ``run_elastic`` itself is a pipeline of ``sparktrain.driver.run``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Mapping

from ...seam import worker_env
from ...errors import InsufficientResourcesError, InvalidArgumentError
from ..launch import cluster, views
from . import resume
from . import supervision as core
from ..launch.config import RunConfig

log = logging.getLogger("sparktrain")

#: Horovod's default for how long to wait for enough slots.
ELASTIC_TIMEOUT = 600.0
#: Seconds between the poller's looks at the slots while an attempt runs.
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


class ElasticSize:
    """``run_elastic``'s attempts (an ``attempts.Sizer``): each as large as the slots allow, between
    the policy's bounds, waiting for them; while one runs, the poller, and the resize marker it asks
    for; the attempt's number in its ranks' environment (the marker's name)."""

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
        from ... import storage

        url = worker_env.elastic_file(self.url, self.run_id, worker_env.ELASTIC_STATE)
        try:
            meta = storage.read_manifest(url, self.storage_options).get("metadata", {})
        except Exception:  # noqa: BLE001 - no commit yet, or the store is unreachable from here
            return "; no commit yet: the next attempt starts from the beginning"
        epoch, batch = meta.get("epoch"), meta.get("batch")
        where = f", at epoch {epoch}" if epoch is not None else ""
        return "; the next attempt resumes from the last commit" + where + (f", batch {batch}" if where and batch else "")

    @contextlib.contextmanager
    def watch(self, number: int, size: int) -> Iterator["Poller"]:
        poller = Poller(self.slots, self.view.decommissioning_hosts, size, self.policy,
                        lambda resize: self._mark(number, resize))
        poller.start()
        try:
            yield poller
        finally:
            poller.stop.set()
            poller.join()

    def _mark(self, number: int, resize: core.Resize) -> None:
        """Leave attempt ``number``'s resize marker, where its rank 0 looks (``tensorflow.resize``)."""
        from ... import storage

        storage.put_bytes(worker_env.elastic_file(self.url, self.run_id, f"resize-{number}"), resize.why.encode(),
                          self.storage_options)
        log.info("sparktrain: %s: the ranks end this attempt at their next commit, and the next one starts with "
                 "%d rank(s)", resize.why, resize.size)

    def env(self, number: int) -> Mapping[str, str]:
        return {worker_env.ELASTIC_ATTEMPT: str(number)}


class Poller(threading.Thread):
    """While an attempt of ``size`` ranks runs: the slots, and the hosts leaving when there are
    fewer than ranks, once a second, into the core's ``resize``; when it decides one, ``mark``
    leaves the marker, and :attr:`resize` says what was asked. At most once per attempt."""

    def __init__(self, slots: Callable[[], int], leaving: Callable[[], list[str]], size: int, policy: core.Elastic,
                 mark: Callable[[core.Resize], None]):
        super().__init__(name="sparktrain-elastic-resize", daemon=True)
        self.slots, self.leaving, self.size, self.policy, self.mark = slots, leaving, size, policy, mark
        self.stop = threading.Event()
        self.resize: core.Resize | None = None

    def run(self) -> None:
        since = None
        while not self.stop.wait(POLL_SECONDS):
            try:
                slots = self.slots()
                leaving = self.leaving() if slots < self.size else []
            except Exception:  # noqa: BLE001 - a Py4J call from this thread failed (seen: a reset); look again
                since = None
                continue
            decided = core.resize(slots, leaving, self.size, self.policy.high, since, time.monotonic(),
                                  self.policy.grow_after)
            if isinstance(decided, core.Watch):
                since = decided.since
                continue
            self.mark(decided)
            self.resize = decided
            return
