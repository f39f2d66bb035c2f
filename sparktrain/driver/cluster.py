"""The Spark cluster as the driver sees it: the session, the kind of master, task slots and GPUs.

pyspark is imported inside the functions that need it. Every question about "is this a local
master", "how many executors should there be" or "what did Spark's error say" is answered here,
once, for ``run``, ``sparktrain check`` and the CLI.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time
from typing import Any, Callable, Iterable, Mapping

from ..errors import InsufficientResourcesError
from . import preflight
from .preflight import Capacity

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


def expected_executors(master: str, conf: Mapping[str, str]) -> int | None:
    """How many executors the cluster should have once all registered; None when nobody says."""
    if is_local(master):
        return 1
    m = _LOCAL_CLUSTER.fullmatch(master)
    if m:
        return int(m.group(1))
    if conf.get("spark.executor.instances"):
        return int(conf["spark.executor.instances"])
    return None


# -- the session -------------------------------------------------------------------------------------

def active_session():
    """The SparkSession this process already runs, or None."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        spark = getattr(SparkSession, "_instantiatedSession", None)
    return spark


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

def capacity(sc, conf: Mapping[str, str]) -> Capacity:
    """Ask Spark what the cluster offers one barrier stage right now."""
    jsc = sc._jsc.sc()
    master = sc.master
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    task_gpus = preflight.gpu_amount(conf, "task")
    spark_slots = None
    try:
        spark_slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal API; fall back to arithmetic from the conf
        pass
    m = _LOCAL.fullmatch(master)
    if m:
        slots = m.group(1)
        cores = 1 if slots is None else (os.cpu_count() or 1) if slots == "*" else int(slots)
        return Capacity(1, cores, task_cpus, preflight.gpu_amount(conf, "driver"), task_gpus, spark_slots)
    executors = max(0, jsc.getExecutorMemoryStatus().size() - 1)  # minus the driver
    m = _LOCAL_CLUSTER.fullmatch(master)
    cores = int(m.group(2)) if m else int(conf.get("spark.executor.cores", "0") or 0)
    if not cores and executors:
        cores = max(1, (spark_slots or 0) * task_cpus // executors)
    return Capacity(executors, cores, task_cpus, preflight.gpu_amount(conf, "executor"), task_gpus, spark_slots)


def wait_for_executors(sc, conf: Mapping[str, str], enough: Callable[[Capacity], bool], wait: float) -> Capacity:
    """Poll the cluster's capacity until ``enough(capacity)`` or ``wait`` seconds pass; return the last."""
    deadline = time.monotonic() + wait
    cap = capacity(sc, conf)
    while not enough(cap) and time.monotonic() < deadline:
        time.sleep(0.2)  # executors register with no event the driver's Python side can await
        cap = capacity(sc, conf)
    return cap


def wait_for_capacity(sc, conf: Mapping[str, str], size: int, use_gpu: bool, wait: float) -> None:
    """Fail within seconds when the cluster cannot run every rank at once.

    Spark's own barrier check retries for about 10 minutes. sparktrain decides at once when it
    knows how many executors to expect (local masters, local-cluster, spark.executor.instances)
    and they are all registered, or when even all of them would be too few. Only executors that
    are still registering get up to ``wait`` seconds.
    """
    cap = capacity(sc, conf)
    expected = expected_executors(sc.master, conf)
    if expected is not None and cap.executors < expected and cap.cores_per_executor:
        preflight.check_capacity(size, dataclasses.replace(cap, executors=expected, spark_slots=None), use_gpu)
    try:
        preflight.check_capacity(size, cap, use_gpu)
        return
    except InsufficientResourcesError:
        if expected is not None and cap.executors >= expected:
            raise
    cap = wait_for_executors(sc, conf, lambda c: c.slots(use_gpu) >= size, wait)
    preflight.check_capacity(size, cap, use_gpu)


def local_gpus(size: int) -> list[list[str]]:
    """One GPU id per rank on this machine (local mode), or InsufficientResourcesError."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "-1"):
        count = len([v for v in visible.split(",") if v.strip()])
    else:
        import shutil
        import subprocess
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

_PYTHON_ERROR = re.compile(r"^(\[\w+\] )?[\w.]+(Error|Exception)\b.*:")


def spark_error_reason(error: Any) -> str:
    """The informative part of a Spark (or Py4J) error, without the JVM stack.

    py4j puts "An error occurred while calling" first; Spark puts the stage failure after "Job
    aborted due to stage failure:"; a failed Python task carries the worker's traceback, whose
    last "...Error: ..." line is the cause.
    """
    java = getattr(error, "java_exception", None)
    text = str(java.toString()) if java is not None else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("at ")]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    picked: list[str] = []
    for line in lines:
        if "Job aborted due to stage failure:" in line:
            picked = [line.split("Job aborted due to stage failure:", 1)[1].strip()]
        elif picked and ("Exception:" in line or "Failure" in line) and len(picked) < 2:
            picked.append(line.split("Exception: ", 1)[-1])
    if not picked:
        picked = [next((line for line in lines if not line.startswith("An error occurred while calling")), lines[0])]
    reason = " ".join(picked)
    causes = [line for line in lines if _PYTHON_ERROR.match(line)]
    if "Traceback" in text and causes and causes[-1] not in reason:
        reason = f"{reason[:300]} ... {causes[-1][:500]}"
    return reason[:800]
