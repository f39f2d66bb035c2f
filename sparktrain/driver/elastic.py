"""``run_elastic``: a run whose size follows the cluster, from ``min_num_proc`` to ``max_num_proc`` ranks.

Each attempt is one ``run`` (one barrier stage) of as many ranks as the cluster has slots for
then, up to ``max_num_proc``. When an attempt fails because a rank or a host was lost, the next
attempt starts with the slots there are now, waiting up to ``elastic_timeout`` for at least
``min_num_proc``, and ``hvd.elastic.run`` resumes it from the last ``state.commit()``, which rank
0 wrote under the ``elastic_url`` setting. All attempts share one elastic id, so they share that
state; reset callbacks run with the new size. While an attempt runs, a thread watches the slots:
once more have lasted ``elastic_grow_after`` seconds, or at once when an executor under the run is
being decommissioned (``spark.decommission.enabled``), it leaves a marker, and the ranks end the
attempt at their next commit (``HostsUpdatedInterrupt``; ``CommitStateCallback`` commits at the
end of that step) so the next one starts at the new size. ``reset_limit`` bounds the restarts,
resizes included. Only a lost rank or host restarts the run; an exception of ``train_fn``'s own
ends it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Mapping

from .. import settings
from ..seam import worker_env
from ..errors import InsufficientResourcesError, InvalidArgumentError, RankFailedError, SparkTrainError, UnsupportedError
from . import config
from . import supervision as core

log = logging.getLogger("sparktrain")

#: Horovod's default for how long to wait for enough slots.
ELASTIC_TIMEOUT = 600.0


def run_elastic(train_fn: Callable[..., Any], args: tuple | list = (), kwargs: Mapping[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: Mapping[str, str] | None = None, stdout=None, stderr=None,
                verbose: int = 1, prefix_output_with_timestamp: bool = False, **run_kwargs: Any) -> Any:
    """Run ``train_fn`` on ``num_proc`` ranks, and go on with fewer (down to ``min_num_proc``) when
    ranks or hosts are lost; returns rank 0's value. Horovod's ``horovod.spark.run_elastic``.

    Parameters
    ----------
    num_proc : ranks of the first attempt; default ``max_num_proc``, else every slot.
    min_num_proc : the fewest ranks an attempt may have; default ``num_proc``.
    max_num_proc : the most; default ``num_proc``.
    elastic_timeout : seconds an attempt waits for ``min_num_proc`` slots (default 600).
    reset_limit : the most restarts, of any kind; None: no limit.
    Every other keyword is ``sparktrain.run``'s, except ``max_attempts``. ``train_fn`` keeps its
    state with ``hvd.elastic`` (``state.commit()``, ``@hvd.elastic.run``), and the ``elastic_url``
    setting (``SPARKTRAIN_ELASTIC_URL`` in ``env=`` or the driver's environment, or
    ``spark.sparktrain.elasticUrl``) says where the commits go.
    """
    from . import cluster
    from .run import run

    env = dict(env or {})
    view, elastic_url = _check(num_proc, env, run_kwargs)
    sc, conf = view.sc, view.conf
    use_gpu = bool(run_kwargs.get("use_gpu"))
    slots = cluster.capacity(sc, conf).slots(use_gpu)
    low, first, high = sizes(num_proc, min_num_proc, max_num_proc, slots)
    timeout = settings.parse_seconds("elastic_timeout", elastic_timeout if elastic_timeout is not None
                                     else ELASTIC_TIMEOUT)
    if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int) or reset_limit < 0):
        raise InvalidArgumentError(f"reset_limit must be a non-negative int or None, got {reset_limit!r}")
    if cluster.is_local(conf.get("spark.master", "")) and low > slots:
        raise InsufficientResourcesError(
            f"min_num_proc={low} ranks cannot run at once: the local master {conf.get('spark.master')} has {slots} "
            f"task slot(s). Lower min_num_proc, or use a master with more slots")
    env[worker_env.ELASTIC_ID] = elastic_id = uuid.uuid4().hex[:12]
    state = worker_env.elastic_file(elastic_url, elastic_id, worker_env.ELASTIC_STATE)
    grow_after = config.settings_of(conf, {**os.environ, **env}).elastic_grow_after
    options = run_kwargs.get("storage_options")
    resets, size, reason, attempt = 0, first, "", 0
    while True:
        size = _wait_for_slots(sc, conf, use_gpu, low, size, high, timeout, reason)
        attempt += 1
        env[worker_env.ELASTIC_ATTEMPT] = str(attempt)
        resizer = _Resizer(sc, conf, use_gpu, size, high, grow_after,
                           worker_env.elastic_file(elastic_url, elastic_id, f"resize-{attempt}"), options)
        resizer.start()
        try:
            return run(train_fn, args, kwargs, num_proc=size, start_timeout=start_timeout, env=env, stdout=stdout,
                       stderr=stderr, verbose=verbose, prefix_output_with_timestamp=prefix_output_with_timestamp,
                       max_attempts=1, **run_kwargs)
        except InsufficientResourcesError as e:
            reason = f"the slots went while it launched ({e})"  # not a reset: nothing ran
            size = low
            continue
        except SparkTrainError as e:
            resets += 1
            restart = core.elastic_restart(e, resizer.resized, resets, reset_limit)
            if restart.resized:
                reason, size = resizer.why + _last_commit(state, options), restart.size
            else:
                reason, size = _lost(e) + _last_commit(state, options), high
                _settle(sc, conf, use_gpu)
        finally:
            resizer.stop.set()
            resizer.join()


def _check(num_proc, env: Mapping[str, str], run_kwargs: Mapping[str, Any]):
    """Refuse what run_elastic cannot do, before anything launches; return the cluster's view and
    the elastic_url setting."""
    from . import cluster, views

    if "max_attempts" in run_kwargs:
        raise InvalidArgumentError("run_elastic does not take max_attempts: it restarts as long as at least min_num_proc "
                                   "ranks can run; bound the restarts with reset_limit=")
    if run_kwargs.get("local_mode") or (isinstance(num_proc, int) and num_proc < 0):
        raise InvalidArgumentError("run_elastic runs on a Spark cluster; local mode has no executors to lose")
    spark = cluster.active_session()
    view = views.of(spark) if spark is not None else None
    if view is None or not view.lists_executors:
        raise UnsupportedError("run_elastic needs an active classic SparkSession (SparkSession.builder...getOrCreate()); "
                               "it counts the cluster's slots through the SparkContext, which Spark Connect does not have")
    elastic_url = config.settings_of(view.conf, {**os.environ, **env}).elastic_url
    if not elastic_url:
        raise InvalidArgumentError(
            "run_elastic resumes each attempt from the last state.commit(), which needs a place every attempt can read: "
            "set the elastic_url setting to an fsspec URL, e.g. env={'SPARKTRAIN_ELASTIC_URL': "
            "'abfss://container@account.dfs.core.windows.net/elastic'} (or the driver's SPARKTRAIN_ELASTIC_URL, or "
            "spark.sparktrain.elasticUrl)")
    return view, elastic_url


class _Resizer(threading.Thread):
    """While an attempt of ``size`` ranks runs, watch the cluster's slots and leave the marker at
    which the ranks end the attempt at their next commit (``sparktrain.tensorflow.resize``):

    - at once when there are fewer slots than ranks while the ranks still run: an executor under
      the run is being decommissioned (Spark no longer counts it), so the ranks commit at the end
      of their step and the next attempt starts without it;
    - once slots for more ranks (up to ``high``) have lasted ``after`` seconds. At most once per
      attempt, and never in an attempt younger than ``after``, so an executor that comes and goes
      cannot restart the run over and over.
    """

    def __init__(self, sc, conf, use_gpu: bool, size: int, high: int, after: float, marker: str, storage_options):
        super().__init__(name="sparktrain-elastic-resize", daemon=True)
        self.sc, self.conf, self.use_gpu, self.size, self.high = sc, conf, use_gpu, size, high
        self.after, self.marker, self.storage_options = after, marker, storage_options
        self.stop = threading.Event()
        #: The size the next attempt should have, once the marker is down; the reason, for the log.
        self.resized = 0
        self.why = ""

    def run(self) -> None:
        from .. import storage
        from . import cluster

        since = None
        while not self.stop.wait(1.0):
            try:
                slots = cluster.capacity(self.sc, self.conf).slots(self.use_gpu)
                leaving = cluster.decommissioning_hosts(self.sc) if slots < self.size else []
            except Exception:  # noqa: BLE001 - a Py4J call from this thread failed (seen: a reset); look again
                since = None
                continue
            if slots < self.size and leaving:
                self.resized = max(1, slots)
                self.why = f"host {', '.join(leaving)} is being decommissioned"
            elif slots > self.size and self.size < self.high:
                since = since or time.monotonic()
                if time.monotonic() - since < self.after:
                    continue
                self.resized = min(slots, self.high)
                self.why = f"the cluster has slots for {self.resized} rank(s)"
            else:
                since = None
                continue
            storage.put_bytes(self.marker, self.why.encode(), self.storage_options)
            log.info("sparktrain: %s: the ranks end this attempt at their next commit, and the next one starts with "
                     "%d rank(s)", self.why, self.resized)
            return


def sizes(num_proc, min_num_proc, max_num_proc, slots: int) -> tuple[int, int, int]:
    """``(min, first, max)`` ranks, checked; Horovod's defaults."""
    for name, value in (("num_proc", num_proc), ("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name} must be a positive int or None, got {value!r}")
    first = num_proc or max_num_proc or max(1, slots)
    low = min_num_proc or first
    high = max_num_proc or max(first, low)
    if not low <= first <= high:
        raise InvalidArgumentError(f"run_elastic needs min_num_proc <= num_proc <= max_num_proc, got {low} <= {first} <= "
                                   f"{high}")
    return low, first, high


def _wait_for_slots(sc, conf, use_gpu: bool, low: int, want: int, high: int, timeout: float, reason: str) -> int:
    """As many ranks as there are slots for, between ``low`` and ``min(want, high)``; waits up to
    ``timeout`` for ``low``. Logs the change in one line when ``reason`` says why."""
    from . import cluster

    slots = cluster.wait_for_executors(sc, conf, lambda c: c.slots(use_gpu) >= low, timeout).slots(use_gpu)
    if slots < low:
        raise InsufficientResourcesError(
            f"run_elastic waited {timeout:g} s for at least min_num_proc={low} slot(s); the cluster has {slots}"
            + (f" ({reason})" if reason else "") + ". Add executors, or lower min_num_proc")
    size = min(slots, want, high)
    if reason:
        log.warning("sparktrain: %s; continuing with %d rank(s)", reason, size)
    return size


def _settle(sc, conf, use_gpu: bool, quiet: float = 3.0, wait: float = 20.0) -> None:
    """Let Spark notice what the failure did: wait until the slot count has not changed for
    ``quiet`` seconds (at most ``wait``), so the next attempt is not sized by a lost executor."""
    from . import cluster

    deadline = time.monotonic() + wait
    last, since = cluster.capacity(sc, conf).slots(use_gpu), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.5)  # executors go with no event the driver's Python side can await
        now = cluster.capacity(sc, conf).slots(use_gpu)
        if now != last:
            last, since = now, time.monotonic()


def _last_commit(url: str, storage_options) -> str:
    """Where the next attempt resumes, as the commit's manifest tells it."""
    from .. import storage

    try:
        meta = storage.read_manifest(url, storage_options).get("metadata", {})
    except Exception:  # noqa: BLE001 - no commit yet, or the store is unreachable from here
        return "; no commit yet: the next attempt starts from the beginning"
    epoch, batch = meta.get("epoch"), meta.get("batch")
    where = f", at epoch {epoch}" if epoch is not None else ""
    return "; the next attempt resumes from the last commit" + where + (f", batch {batch}" if where and batch else "")


def _lost(e: SparkTrainError) -> str:
    if isinstance(e, RankFailedError) and e.failures:
        root = e.root_cause
        where = f" on host {root.host}" if getattr(root, "host", None) else ""
        return f"rank {root.rank}{where} was lost" + (f" ({root.exc_type})" if root.exc_type else "")
    return f"the attempt failed ({str(e).splitlines()[0][:200]})"
