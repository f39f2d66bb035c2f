"""The cluster a run launches on, as the driver sees it: classic Spark, Spark Connect, or local mode.

:func:`choose` is the one place that asks which it is. Each view owns what differs between
them: the conf, the address where ranks reach the driver, the executors' Python check, the
task slots and the wait for them, the run's resource profile, the largest result Spark carries,
the job's group (a job group, or a Connect tag) and its cancellation, the default rendezvous,
the job that runs the ranks, and what an elastic run watches (slots, executors being
decommissioned). ``run``, ``run_elastic`` and ``sparktrain check`` read the
cluster through a view only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping

from ...errors import InsufficientResourcesError, InvalidArgumentError, UnsupportedError
from ...seam.spec import TaskSpec
from . import capacity as rules
from . import cluster, connect
from .capacity import Capacity, TaskResources
from .jobs import Job, LocalJob, SparkJob

log = logging.getLogger("sparktrain")


class ClusterView:
    """What every view answers; see the module's doc."""

    #: Words for the log and the check's report.
    name = ""
    #: Who the ranks check in with: "driver" or "client".
    here = "driver"
    spark: Any = None
    #: Whether ranks that meet through Spark's barrier send their output tails back with the result
    #: (where this process cannot read the executors' logs: Spark Connect).
    tails_without_channel = False
    #: Whether the view can list the executors registered now (``wait_for_executors``); otherwise
    #: ``capacity`` counts what the conf promises.
    lists_executors = False

    def __init__(self, conf: Mapping[str, str]):
        self.conf = dict(conf)
        self.master = self.conf.get("spark.master", "")

    def driver_host(self) -> str:
        """Where executors reach this process."""
        return "127.0.0.1"

    def check_python(self, rendezvous: str) -> None:
        """Refuse, before launch, executors whose Python cannot run a rank's task."""

    def default_rendezvous(self, setting: str, host: str, run_id: str) -> str:
        """How ranks meet, for the ``rendezvous`` setting (``auto``, ``driver`` or ``barrier``)."""
        return "driver" if setting == "auto" else setting

    def meet(self, values, run_id: str, local: bool = False):
        """What a run needs the cluster to say before it resolves (``config.Met``), asked once: the
        executors' Python checked, where the ranks reach this process (the ``nics`` setting's
        address where one is set), and how they meet, for the ``rendezvous`` setting."""
        from .config import Met

        if local:
            return Met()
        self.check_python(values.rendezvous)
        host = self.driver_host()
        if values.nics:
            from ...host import nics as networks

            host = networks.own_address(values.nics, "the driver")
            log.info("sparktrain: nics=%s: the ranks reach this driver at %s", ",".join(values.nics), host)
        return Met(host, self.default_rendezvous(values.rendezvous, host, run_id))

    def profile(self, stage: TaskResources):
        raise UnsupportedError(f"{self.name} has no stage-level resource profiles")

    def capacity(self, stage: TaskResources | None = None, profile=None) -> Capacity | None:
        """The task slots one barrier stage gets now; None where they cannot be counted."""
        return None

    def slots(self, use_gpu: bool, stage: TaskResources | None = None, profile=None) -> int:
        """The ranks one barrier stage can run at once now (0 where they cannot be counted)."""
        cap = self.capacity(stage, profile)
        return cap.slots(use_gpu) if cap is not None else 0

    def wait_for_slots(self, low: int, use_gpu: bool, wait: float, stage: TaskResources | None = None,
                       profile=None) -> int:
        """The slots, once there are at least ``low``, or after ``wait`` seconds (only a view that
        lists executors waits)."""
        return self.slots(use_gpu, stage, profile)

    def decommissioning_hosts(self) -> list[str]:
        """The hosts of executors being decommissioned, whose slots Spark no longer counts."""
        return []

    def fit(self, size: int | None, use_gpu: bool, stage: TaskResources | None, profile, wait: float) -> int:
        """Check (waiting up to ``wait`` seconds for executors) that ``size`` ranks fit at once;
        return the size (every slot when ``size`` is None)."""
        raise NotImplementedError

    def max_result_bytes(self) -> int:
        return 0

    @contextlib.contextmanager
    def group(self, name: str, description: str) -> Iterator[None]:
        """The jobs this thread starts inside belong to ``name``, which :meth:`cancel` stops."""
        yield

    def cancel(self, name: str) -> None:
        pass

    def hush_console_progress(self) -> None:
        """Keep Spark's console progress bar (``[Stage 4:> (0 + 3) / 3]``) from drawing over the ranks'
        lines for the next half second, where this view's Spark draws one."""

    def job(self, spec: TaskSpec, fn_name: str, on_done: Callable[[], None], source=None, profile=None) -> Job:
        raise NotImplementedError

    def stage(self, size: int, task: Callable, barrier: bool) -> list[str]:
        """Collect a stage of ``size`` tasks, each running ``task`` (an iterator of rows in, of
        strings out), as the executor probe needs (``driver.launch.probe``)."""
        raise UnsupportedError(f"{self.name} runs no Spark stages")


class LocalView(ClusterView):
    """Local mode: the ranks run on this machine, started by driver threads; no Spark."""

    name = "local mode"

    def __init__(self, gpus: list[list[str]] | None = None):
        super().__init__({})
        self.gpus = gpus

    def fit(self, size, use_gpu, stage, profile, wait) -> int:
        return size

    def job(self, spec, fn_name, on_done, source=None, profile=None) -> Job:
        return LocalJob(spec, self.gpus, on_done)


class SparkView(ClusterView):
    """A classic SparkSession: the driver's SparkContext answers through Py4J."""

    name = "Spark"
    lists_executors = True

    def __init__(self, spark):
        self.spark = spark
        self.sc = spark.sparkContext
        super().__init__(cluster.spark_conf(self.sc))
        #: Spark's ConsoleProgressBar (a Py4J object), False where Spark draws none; None: not asked yet.
        self._progress_bar = None

    def driver_host(self) -> str:
        return self.conf.get("spark.driver.host", "127.0.0.1")

    def check_python(self, rendezvous: str) -> None:
        cluster.check_executors_python(self.sc)

    def profile(self, stage: TaskResources):
        _check_profile_support(self.spark, stage)
        return cluster.task_profile(self.sc, stage)

    def capacity(self, stage=None, profile=None) -> Capacity:
        return cluster.capacity(self.sc, self.conf, stage, profile)

    def wait_for_executors(self, enough: Callable[[Capacity], bool], wait: float) -> Capacity:
        return cluster.wait_for_executors(self.sc, self.conf, enough, wait)

    def wait_for_slots(self, low, use_gpu, wait, stage=None, profile=None) -> int:
        enough = lambda c: c.slots(use_gpu) >= low  # noqa: E731
        return cluster.wait_for_executors(self.sc, self.conf, enough, wait, stage, profile).slots(use_gpu)

    def decommissioning_hosts(self) -> list[str]:
        return cluster.decommissioning_hosts(self.sc)

    def fit(self, size, use_gpu, stage, profile, wait) -> int:
        if size is None:
            size = max(1, self.capacity(stage, profile).slots(use_gpu))
        cluster.wait_for_capacity(self.sc, self.conf, size, use_gpu, wait, stage, profile)
        return size

    def max_result_bytes(self) -> int:
        return int(self.sc._jsc.sc().conf().getSizeAsBytes("spark.driver.maxResultSize", "1g"))

    @contextlib.contextmanager
    def group(self, name, description):
        self.sc.setJobGroup(name, description, interruptOnCancel=True)
        yield

    def cancel(self, name: str) -> None:
        self.sc.cancelJobGroup(name)

    def hush_console_progress(self) -> None:
        # Spark draws the bar (spark.ui.showConsoleProgress) from a timer every 200 ms, for every
        # active stage, and not within 500 ms of its finishAll(), which also erases what it drew.
        if self._progress_bar is None:
            bar = self.sc._jsc.sc().progressBar()
            self._progress_bar = bar.get() if bar.isDefined() else False
        if self._progress_bar:
            self._progress_bar.finishAll()

    def job(self, spec, fn_name, on_done, source=None, profile=None) -> Job:
        return SparkJob(self, spec, fn_name, on_done, source, profile)

    def stage(self, size, task, barrier) -> list[str]:
        # An RDD stage needs nothing but Python on the executors: the probe reports a missing pyarrow
        # instead of failing on it.
        rdd = self.sc.parallelize(range(size), size)
        return (rdd.barrier() if barrier else rdd).mapPartitions(task).collect()


class ConnectView(ClusterView):
    """A Spark Connect client: no SparkContext; the conf, tags and probes go through the server."""

    name = "Spark Connect"
    here = "client"
    tails_without_channel = True

    def __init__(self, spark):
        self.spark = spark
        super().__init__(connect.conf_of(spark))

    def driver_host(self) -> str:
        return connect.client_host(self.spark)

    def check_python(self, rendezvous: str) -> None:
        # The probe that chooses the rendezvous reports the executors' Python too, once per session.
        connect.check_executors_python(self, self.driver_host() if rendezvous == "auto" else None)

    def default_rendezvous(self, setting: str, host: str, run_id: str) -> str:
        if setting != "auto":
            return setting
        reach = connect.executors_reach(self, host)
        log.info("sparktrain: run %s over Spark Connect: executors %s this client at %s; ranks meet through %s",
                 run_id, "can reach" if reach else "cannot reach", host,
                 "its channel, and their output streams here live" if reach else
                 "Spark's barrier allGather, and each rank's output tail comes back with the result or error")
        return "driver" if reach else "barrier"

    def profile(self, stage: TaskResources):
        _check_profile_support(self.spark, stage)
        profile = cluster.task_profile(None, stage)  # the server registers it
        connect.register_profile(self.spark, profile)
        return profile

    def capacity(self, stage=None, profile=None) -> Capacity | None:
        cap = connect.capacity(self.conf)
        if cap is not None and stage is not None:
            cap = dataclasses.replace(cap, task_cpus=stage.cpus, task_gpus=stage.gpus or 0.0, profile=True)
        return cap

    def fit(self, size, use_gpu, stage, profile, wait) -> int:
        """The client cannot list executors: count slots from the conf, or, where the conf does not
        say, probe with a job of ``size`` tasks that must all run at once within ``wait`` seconds.
        Fails now rather than wait out Spark's barrier slot check (about 10 minutes)."""
        conf = self.conf
        cap = self.capacity(stage)
        checked = (f"counted from the session's conf (spark.master={conf.get('spark.master', '?')}, "
                   f"spark.executor.instances={conf.get('spark.executor.instances', 'unset')}, "
                   f"spark.executor.cores={conf.get('spark.executor.cores', 'unset')}, "
                   f"spark.task.cpus={conf.get('spark.task.cpus', '1')})")
        if cap is not None:
            if size is None:
                return max(1, cap.slots(use_gpu))
            try:
                rules.check_capacity(size, cap, use_gpu)
            except InsufficientResourcesError as e:
                raise InsufficientResourcesError(f"{e} (slots {checked})") from None
            return size
        if size is None:
            raise InvalidArgumentError(
                "num_proc is required over Spark Connect when the conf does not say how many executors there "
                f"are (spark.executor.instances/cores unset); {checked}")
        host = self.driver_host()
        if stage is not None or not connect.executors_reach(self, host):
            log.info("sparktrain: over Spark Connect the task slots cannot be %s, nor probed from here; "
                     "launching %d ranks", checked, size)
            return size
        running = connect.concurrent_slots(self, host, size, wait)
        if running < size:
            raise InsufficientResourcesError(
                f"num_proc={size} needs {size} task slots at once, but only {running} task(s) of a probe job of "
                f"{size} ran at once within {wait:g} s (the conf does not say: {checked}). Lower num_proc, add "
                "executors, or set spark.executor.instances and spark.executor.cores so the count comes from the "
                "conf; spark.sparktrain.capacityWait waits longer for executors to come up")
        log.info("sparktrain: %d tasks ran at once in a probe job (the conf does not say how many executors "
                 "there are)", running)
        return size

    def max_result_bytes(self) -> int:
        return connect.size_bytes(self.conf.get("spark.driver.maxResultSize", "1g"))

    @contextlib.contextmanager
    def group(self, name, description):
        # A Connect client has no job groups; a tag marks this thread's jobs for interruptTag.
        self.spark.addTag(name)
        try:
            yield
        finally:
            self.spark.removeTag(name)

    def cancel(self, name: str) -> None:
        self.spark.interruptTag(name)

    def job(self, spec, fn_name, on_done, source=None, profile=None) -> Job:
        return SparkJob(self, spec, fn_name, on_done, source, profile)

    def stage(self, size, task, barrier) -> list[str]:
        def in_arrow(batches):  # Connect has no RDDs
            import pyarrow as pa

            yield pa.RecordBatch.from_arrays([pa.array(list(task(batches)))], names=["info"])

        rows = self.spark.range(0, size, 1, size).mapInArrow(in_arrow, "info string", barrier=barrier).collect()
        return [r["info"] for r in rows]


def _check_profile_support(spark, stage: TaskResources) -> None:
    import pyspark

    rules.check_profile_support(type(spark.range(0)).mapInArrow, pyspark.__version__)  # no job runs
    log.info("sparktrain: each rank's task asks for %d CPU(s) and %g GPU(s) through its own resource profile",
             stage.cpus, stage.gpus)


def of(spark) -> ClusterView:
    """The view of a SparkSession: the one place that tells Spark Connect from classic Spark."""
    return ConnectView(spark) if cluster.is_connect(spark) else SparkView(spark)


def active() -> ClusterView | None:
    """The active session's view, or None where there is no active session."""
    spark = cluster.active_session()
    return of(spark) if spark is not None else None


def choose(local: bool, size: int | None, use_gpu: bool | None) -> ClusterView:
    """The view a run launches on: local mode, else the active session's (an embedded
    ``local[size]`` session is started when there is none)."""
    if local:
        return LocalView(cluster.local_gpus(size) if use_gpu else None)
    spark = cluster.active_session()
    if spark is None:
        import os

        master = f"local[{size or os.cpu_count() or 1}]"
        spark = cluster.start_session(master)
        log.info("sparktrain: no active SparkSession; started an embedded %s session", master)
    return of(spark)
