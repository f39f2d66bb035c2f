"""The Spark cluster as the driver sees it: the session, the kind of master, task slots and GPUs.

pyspark is imported inside the functions that need it. Every question about "is this a local
master", "how many executors should there be" or "what did Spark's error say" is answered here,
once, for ``run``, ``sparktrain check`` and the CLI; what Spark's errors say is in
``spark_errors``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from typing import Callable, Iterable, Mapping

from ...errors import ClusterConfigError, InsufficientResourcesError
from . import capacity as rules
from .capacity import Capacity
from ..show.spark_errors import spark_error_reason


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (its class lives in ``pyspark.sql.connect``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


#: What pyspark warns about where pandas 3 is installed (a regular expression): once per process,
#: when it first imports its testing helpers (a SparkContext starting does), and on every Arrow stage.
PYSPARK_PANDAS_WARNING = "PySpark does not yet fully support pandas"


@contextlib.contextmanager
def without_pyspark_warnings():
    """Hide the warnings pyspark gives for what sparktrain itself asks of Spark (its session, its
    stages, the scoring UDF), which the user did not cause: the pandas-version FutureWarning (the
    stages use no pandas API, and the scoring is tested with pandas 3); and pyspark 3.5's, at every
    stage, a distutils DeprecationWarning from its check of the pandas and pyarrow versions, and a
    ResourceWarning for the socket its collect leaves unclosed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", PYSPARK_PANDAS_WARNING, FutureWarning)
        warnings.filterwarnings("ignore", "distutils Version classes are deprecated", DeprecationWarning,
                                r"pyspark\.sql\.pandas\.utils")
        warnings.filterwarnings("ignore", "unclosed <socket", ResourceWarning)
        yield


log = logging.getLogger("sparktrain")

_LOCAL = re.compile(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[(\d+),\s*(\d+),\s*(\d+)\]")


# -- the kind of master ------------------------------------------------------------------------------

def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N,F]``: the driver's JVM runs the tasks itself."""
    return _LOCAL.fullmatch(master) is not None


def on_this_host(master: str) -> bool:
    """Local masters and ``local-cluster``: the executors share this machine (its disk, its Python)."""
    return is_local(master) or master.startswith("local-cluster[")


def local_cores(master: str) -> int | None:
    """The task slots a local master's one JVM runs (``local[*]``: this machine's cores); None
    for any other master.

    >>> local_cores("local[3]"), local_cores("local"), local_cores("yarn")
    (3, 1, None)
    """
    m = _LOCAL.fullmatch(master)
    if m is None:
        return None
    slots = m.group(1)
    return 1 if slots is None else (os.cpu_count() or 1) if slots == "*" else int(slots)


def local_cluster_shape(master: str) -> tuple[int, int] | None:
    """``(executors, cores per executor)`` of a ``local-cluster[N,C,M]`` master; None otherwise."""
    m = _LOCAL_CLUSTER.fullmatch(master)
    return (int(m.group(1)), int(m.group(2))) if m else None


def expected_executors(master: str, conf: Mapping[str, str]) -> int | None:
    """How many executors the cluster should have once all registered; None when nobody says."""
    if is_local(master):
        return 1
    shape = local_cluster_shape(master)
    if shape:
        return shape[0]
    if conf.get("spark.executor.instances"):
        return int(conf["spark.executor.instances"])
    return None


# -- the session -------------------------------------------------------------------------------------

def active_session():
    """The SparkSession this process already runs, or None.

    The active session is per thread; from another thread (a notebook's background job, say),
    the process's default Spark Connect session comes first: an embedded Connect server also
    holds a classic session in this process, and that one is the server's, not the user's.
    """
    import sys

    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None and "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        spark = ConnectSession._get_default_session()
    if spark is None:
        spark = getattr(SparkSession, "_instantiatedSession", None)
    return spark


def spark_conf(sc) -> dict[str, str]:
    """The SparkContext's conf, read from the context's own SparkConf.

    ``sc.getConf()`` would copy it first, one Py4J call per entry, before ``getAll()`` reads the
    copy entry by entry again; the context's own conf is read once.
    """
    return dict(sc._conf.getAll())


def start_session(master: str | None, conf: Iterable[tuple[str, str]] = ()):
    """Start a SparkSession, or get the one whose master spark-submit chose (``master=None``).

    When sparktrain chooses the master, executors on this host run this interpreter, Spark's
    progress bar stays out of the ranks' output, and failed tasks are not logged twice
    (see :func:`quiet_task_failures`).
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if master is not None:
        if on_this_host(master) and not os.environ.get("PYSPARK_PYTHON"):
            # The executors must run this interpreter, where sparktrain and the user's packages
            # are; pyspark reads only this variable to choose the workers' Python.
            os.environ["PYSPARK_PYTHON"] = sys.executable
        # Ranks' output streams to this console; Spark's progress bar would cut through it.
        builder = builder.master(master).appName("sparktrain").config("spark.ui.showConsoleProgress", "false")
    for key, value in conf:
        builder = builder.config(key, value)
    with without_pyspark_warnings():
        spark = builder.getOrCreate()
    if master is not None:
        quiet_task_failures(spark)
    return spark


def quiet_task_failures(spark) -> None:
    """In a session sparktrain started itself, Spark need not log each failed rank's task.

    sparktrain reports a failed rank once, root cause first; Spark would log the same failure
    again per task, with a JVM stack trace, at ERROR and WARN.
    """
    try:
        jvm = spark.sparkContext._jvm
        level = jvm.org.apache.logging.log4j.Level.FATAL
        for name in ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager",
                     "org.apache.spark.scheduler.DAGScheduler"):  # "cannot find active jobs" after a cancel
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, level)
    except Exception as e:  # noqa: BLE001 - logging set-up must never stop a run
        log.debug("sparktrain: could not quiet Spark's task-failure logging: %s", e)


# -- capacity ----------------------------------------------------------------------------------------

def task_profile(sc, task: rules.TaskResources):
    """The pyspark ResourceProfile asking ``task.cpus`` cores and ``task.gpus`` GPUs for each task
    of the run's barrier stage (a task-only profile: the executors stay as they are).

    Built once per run and, with a SparkContext ``sc``, registered with Spark, so that the capacity
    check can ask Spark how many tasks of it fit at once; over Spark Connect (``sc=None``) it is built
    on the client and the server registers it with the stage. Needs pyspark 4.0 or later
    (``capacity.check_profile_support``).
    """
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(task.cpus)
    if task.gpus:
        requests = requests.resource("gpu", task.gpus)
    profile = ResourceProfileBuilder().require(requests).build
    jprofile = getattr(profile, "_java_resource_profile", None)
    if sc is not None and jprofile is not None:  # a Connect client (sc None) leaves it to the server
        try:
            sc._jsc.sc().resourceProfileManager().addResourceProfile(jprofile)
        except Exception as e:  # noqa: BLE001 - Spark says why it refuses the profile; say it with the fix
            raise ClusterConfigError(
                f"Spark refuses the run's resource profile (cpus={task.cpus}, gpus={task.gpus:g} per rank): "
                f"{spark_error_reason(e)}. Stage-level task resources need a standalone, YARN or Kubernetes "
                "cluster with spark.dynamicAllocation.enabled=false") from None
    return profile


def capacity(sc, conf: Mapping[str, str], task: rules.TaskResources | None = None, profile=None) -> Capacity:
    """Ask Spark what the cluster offers one barrier stage right now.

    With ``task`` (and its ``profile``, see :func:`task_profile`) the slots are counted for the
    run's own task resources instead of the application's default task profile.
    """
    jsc = sc._jsc.sc()
    spark_slots = None
    try:
        spark_slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal API; fall back to arithmetic from the conf
        pass
    if task is not None:
        cap = _default_capacity(sc, conf, spark_slots)
        slots = None
        jprofile = getattr(profile, "_java_resource_profile", None)
        if jprofile is not None:
            try:
                slots = int(jsc.maxNumConcurrentTasks(jprofile))
            except Exception:  # noqa: BLE001 - as above
                pass
        return dataclasses.replace(cap, task_cpus=task.cpus, task_gpus=task.gpus or 0.0, spark_slots=slots,
                                   profile=True)
    return _default_capacity(sc, conf, spark_slots)


def _default_capacity(sc, conf: Mapping[str, str], spark_slots: int | None) -> Capacity:
    """The registered executors' slots (the driver, listed among them, is not counted)."""
    executors = None if local_cores(sc.master) else max(0, sc._jsc.sc().getExecutorMemoryStatus().size() - 1)
    return counted_capacity({**conf, "spark.master": sc.master}, executors, spark_slots)


def counted_capacity(conf: Mapping[str, str], executors: int | None = None,
                     spark_slots: int | None = None) -> Capacity | None:
    """The slots of the conf's master: a local master's cores; else ``executors`` (those registered,
    where they can be listed) or, with ``executors=None``, the executors the conf promises, of
    ``spark.executor.cores`` each (local-cluster's shape, where it says). None when the conf does
    not say (dynamic allocation, or executors whose count is not configured)."""
    master = conf.get("spark.master", "")
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    task_gpus = rules.gpu_amount(conf, "task")
    cores = local_cores(master)
    if cores is not None:
        return Capacity(1, cores, task_cpus, rules.gpu_amount(conf, "driver"), task_gpus, spark_slots)
    shape = local_cluster_shape(master)
    if executors is None:
        dynamic = conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true"
        instances = shape[0] if shape else conf.get("spark.executor.instances")
        if not shape and (dynamic or not instances or not conf.get("spark.executor.cores")):
            return None
        executors = int(instances)
    cores = shape[1] if shape else int(conf.get("spark.executor.cores", "0") or 0)
    if not cores and executors:
        cores = max(1, (spark_slots or 0) * task_cpus // executors)
    return Capacity(executors, cores, task_cpus, rules.gpu_amount(conf, "executor"), task_gpus, spark_slots)


def wait_for_executors(sc, conf: Mapping[str, str], enough: Callable[[Capacity], bool], wait: float,
                       task: rules.TaskResources | None = None, profile=None) -> Capacity:
    """Poll the cluster's capacity until ``enough(capacity)`` or ``wait`` seconds pass; return the last."""
    deadline = time.monotonic() + wait
    cap = capacity(sc, conf, task, profile)
    while not enough(cap) and time.monotonic() < deadline:
        time.sleep(0.2)  # executors register with no event the driver's Python side can await
        cap = capacity(sc, conf, task, profile)
    return cap


def wait_for_capacity(sc, conf: Mapping[str, str], size: int, use_gpu: bool, wait: float,
                      task: rules.TaskResources | None = None, profile=None) -> None:
    """Fail within seconds when the cluster cannot run every rank at once.

    Spark's own barrier check retries for about 10 minutes. sparktrain decides at once when it
    knows how many executors to expect (local masters, local-cluster, spark.executor.instances)
    and they are all registered, or when even all of them would be too few. Only executors that
    are still registering get up to ``wait`` seconds.
    """
    cap = capacity(sc, conf, task, profile)
    expected = expected_executors(sc.master, conf)
    if expected is not None and cap.executors < expected and cap.cores_per_executor:
        rules.check_capacity(size, dataclasses.replace(cap, executors=expected, spark_slots=None), use_gpu)
    try:
        rules.check_capacity(size, cap, use_gpu)
        return
    except InsufficientResourcesError:
        if expected is not None and cap.executors >= expected:
            raise
    cap = wait_for_executors(sc, conf, lambda c: c.slots(use_gpu) >= size, wait, task, profile)
    rules.check_capacity(size, cap, use_gpu)


#: What a rank's barrier task imports in the executors' Python before sparktrain can report anything.
TASK_MODULES = ("sparktrain", "cloudpickle", "pyarrow")
_PYTHONS_CHECKED: set[str] = set()


def executors_python(sc) -> str:
    """The interpreter Spark starts the Python workers of this session's jobs with: the
    ``PYSPARK_PYTHON`` the SparkContext read when it started (spark-submit sets it from
    ``spark.pyspark.python``), else ``python3`` from PATH. A ``spark.pyspark.python`` given to a
    session built inside Python does not change it."""
    return getattr(sc, "pythonExec", None) or "python3"


def check_executors_python(sc) -> None:
    """Where the executors run on this host (local masters, local-cluster), make sure their Python
    can import what a rank's task needs; otherwise raise ClusterConfigError naming both
    interpreters and the fix, before anything launches.

    A session built without ``PYSPARK_PYTHON`` runs its executors on ``python3`` from PATH, which
    is not the venv's interpreter when the script was started as ``.venv/bin/python train.py``.
    The check asks that interpreter to find the modules without importing them, once per
    interpreter and process; it is skipped when the executors run this very interpreter.
    """
    if not on_this_host(sc.master):
        return
    exe = executors_python(sc)
    path = shutil.which(exe) or exe
    if os.path.abspath(path) == os.path.abspath(sys.executable) or path in _PYTHONS_CHECKED:
        return
    code = f"import importlib.util as u; print(' '.join(m for m in {TASK_MODULES!r} if u.find_spec(m) is None))"
    try:
        proc = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=30)
        missing = proc.stdout.split()
        problem = (f"cannot import {', '.join(missing)}" if missing else None) if proc.returncode == 0 else \
            f"fails to start: {(proc.stderr.strip().splitlines() or ['exit code %d' % proc.returncode])[-1]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"cannot be run: {e}"
    if problem is None:
        _PYTHONS_CHECKED.add(path)
        return
    where = exe if path == exe else f"{exe} ({path})"
    raise ClusterConfigError(
        f"the executors' Python, {where}, {problem}; this driver runs {sys.executable}. PySpark starts the "
        "executors' Python from PYSPARK_PYTHON, read when the SparkSession starts (spark-submit sets it from "
        f"spark.pyspark.python). Fix: export PYSPARK_PYTHON={sys.executable} before starting Python, or set "
        "os.environ[\"PYSPARK_PYTHON\"] = sys.executable before building the session; or install sparktrain, "
        f"cloudpickle and pyarrow for {where}")


def local_gpus(size: int) -> list[list[str]]:
    """One GPU id per rank on this machine (local mode), or InsufficientResourcesError."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "-1"):
        count = len([v for v in visible.split(",") if v.strip()])
    else:
        smi = shutil.which("nvidia-smi")
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout if smi else ""
        count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if count < size:
        raise InsufficientResourcesError(
            f"local mode with use_gpu=True needs {size} GPUs, one per rank, but this machine shows {count}. "
            f"Lower num_proc to {count} or pass use_gpu=False" if count else
            f"local mode with use_gpu=True needs {size} GPUs, but this machine shows none; pass use_gpu=False")
    return [[str(i)] for i in range(size)]


# -- Spark's errors ----------------------------------------------------------------------------------


def decommissioning_hosts(sc) -> list[str]:
    """The hosts of executors Spark is decommissioning (``spark.decommission.enabled``: a worker or
    executor announced that it is leaving; Spark no longer counts its slots). Best effort, through
    the scheduler's JVM objects; [] where they cannot be read."""
    jsc = sc._jsc.sc()
    hosts: list[str] = []
    try:
        pending = jsc.taskScheduler().executorsPendingDecommission()
        keys = pending.keysIterator()
        while keys.hasNext():
            executor = keys.next()
            worker = pending.get(executor).get().workerHost()
            host = worker.get() if worker.isDefined() else \
                str(jsc.statusStore().executorSummary(executor).hostPort()).rsplit(":", 1)[0]
            if host not in hosts:
                hosts.append(host)
    except Exception:  # noqa: BLE001 - internal APIs: without them, a shrink is not told apart from a loss
        return hosts
    return hosts
