"""Slot arithmetic and resources per run: what one barrier stage needs and what the cluster offers.

Pure: no Spark imports (``sparktrain.driver.launch.cluster`` asks Spark and hands the figures here).
Each check says what was required, what is available, which resource limits it, and the fix.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from ...errors import ClusterConfigError, InsufficientResourcesError, InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster offers to one barrier stage."""

    executors: int
    cores_per_executor: int
    task_cpus: int
    gpus_per_executor: float = 0.0
    task_gpus: float = 0.0
    #: Spark's own count of concurrent task slots, when it could be asked; it is authoritative.
    spark_slots: int | None = None
    #: True when the task figures come from the run's own ResourceProfile (``resources=``), not the conf.
    profile: bool = False

    @property
    def cpus_label(self) -> str:
        return "cpus per rank (the run's resource profile)" if self.profile else "spark.task.cpus"

    @property
    def gpus_label(self) -> str:
        return "gpus per rank (the run's resource profile)" if self.profile else "spark.task.resource.gpu.amount"

    @property
    def cpu_slots(self) -> int:
        return self.executors * (self.cores_per_executor // max(1, self.task_cpus))

    @property
    def gpu_slots(self) -> int:
        if self.task_gpus <= 0:
            return 0
        # Spark allows fractional GPU amounts per task; a 1e-9 guard keeps 1/0.1 from becoming 9.
        return self.executors * int(math.floor(self.gpus_per_executor / self.task_gpus + 1e-9))

    def slots(self, use_gpu: bool) -> int:
        slots = min(self.cpu_slots, self.gpu_slots) if use_gpu else self.cpu_slots
        return slots if self.spark_slots is None else min(slots, self.spark_slots)


def gpu_amount(conf: Mapping[str, str], component: str = "task") -> float:
    """``spark.<component>.resource.gpu.amount`` as a number; 0 when unset.

    >>> gpu_amount({"spark.task.resource.gpu.amount": "0.5"})
    0.5
    """
    return float(conf.get(f"spark.{component}.resource.gpu.amount", "0") or 0)


def check_gpu_conf(conf: Mapping[str, str], use_gpu: bool) -> None:
    if not use_gpu:
        return
    if gpu_amount(conf) <= 0:
        raise ClusterConfigError(
            "use_gpu=True, but spark.task.resource.gpu.amount is not set, so Spark gives tasks no GPU. "
            "Set spark.task.resource.gpu.amount=1, spark.executor.resource.gpu.amount and a GPU "
            "discovery script (see conf/ and docs/cluster-conf.md), or pass use_gpu=False"
        )


# -- resources per run ---------------------------------------------------------------------------

#: The keys ``run(..., resources=...)`` accepts.
RESOURCE_KEYS = ("cpus", "gpus")


@dataclasses.dataclass(frozen=True)
class TaskResources:
    """What each rank's task asks Spark for: CPU cores and GPUs (fractions of a GPU are allowed).

    ``None`` for a field means "as the application's default task profile says".
    """

    cpus: int | None = None
    gpus: float | None = None


def check_resources(resources: Any, use_gpu: bool | None) -> TaskResources | None:
    """Validate ``run``'s ``resources``; None when none were given.

    ``cpus`` is a whole number of cores per rank; ``gpus`` a number of GPUs per rank: a whole
    number, or a fraction of at most 0.5 (Spark's rule for sharing a GPU), or 0 for none.

    >>> check_resources({"cpus": 4, "gpus": 1}, None)
    TaskResources(cpus=4, gpus=1.0)
    """
    if resources is None:
        return None
    if not isinstance(resources, Mapping):
        raise InvalidArgumentError(
            f"resources must be a dict of what each rank's task needs, such as {{'cpus': 4, 'gpus': 1}}, "
            f"got {resources!r} ({type(resources).__name__})")
    unknown = [k for k in resources if k not in RESOURCE_KEYS]
    if unknown:
        raise InvalidArgumentError(
            f"resources has unknown key(s) {unknown!r}; use 'cpus' (cores per rank) and 'gpus' (GPUs per rank), "
            "for example resources={'cpus': 4, 'gpus': 1}")
    if not resources:
        raise InvalidArgumentError("resources is empty; give 'cpus' and/or 'gpus', for example "
                                   "resources={'cpus': 4, 'gpus': 1}, or leave it out")
    cpus = resources.get("cpus")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
        raise InvalidArgumentError(
            f"resources['cpus'] must be a whole number of cores per rank, at least 1, got {cpus!r}; "
            "for example resources={'cpus': 4}")
    gpus = resources.get("gpus")
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not math.isfinite(gpus) or gpus < 0 \
                or (gpus > 0.5 and gpus != int(gpus)):
            raise InvalidArgumentError(
                f"resources['gpus'] must be the GPUs per rank: a whole number (usually 1), a fraction of at most "
                f"0.5 to share a GPU between ranks, or 0 for none; got {gpus!r}")
        gpus = float(gpus)
        if use_gpu is False and gpus > 0:
            raise InvalidArgumentError(
                f"use_gpu=False contradicts resources['gpus']={resources['gpus']!r}; drop use_gpu or ask for "
                "'gpus': 0")
        if use_gpu is True and gpus == 0:
            raise InvalidArgumentError(
                "use_gpu=True contradicts resources['gpus']=0; ask for 'gpus': 1 (or more), or pass use_gpu=False")
    return TaskResources(cpus, gpus)


def default_task_resources(conf: Mapping[str, str]) -> TaskResources:
    """What the application's default task profile asks for (``spark.task.cpus``, GPUs)."""
    return TaskResources(int(conf.get("spark.task.cpus", "1") or 1), gpu_amount(conf))


def stage_resources(conf: Mapping[str, str], asked: TaskResources | None, use_gpu: bool,
                    local_master: bool = False) -> TaskResources | None:
    """The task resources the run's barrier stage must ask for through its own ResourceProfile,
    or None when the application's default task profile already fits.

    ``use_gpu=True`` on an application whose tasks ask for no GPU gets one GPU per rank, provided
    the executors have GPUs. The result is complete (both fields set) when it is not None.
    """
    default = default_task_resources(conf)
    if asked is None and not (use_gpu and not default.gpus):
        return None  # the default profile: today's behaviour
    if asked is None and local_master:
        check_gpu_conf(conf, use_gpu)  # local[N] has no stage-level scheduling: the session's conf decides
    cpus = asked.cpus if asked is not None and asked.cpus is not None else default.cpus
    if asked is not None and asked.gpus is not None:
        gpus = asked.gpus
    elif use_gpu:
        gpus = default.gpus or 1.0
    else:
        gpus = 0.0
    wanted = TaskResources(cpus, gpus)
    if wanted == default:
        return None
    if gpus > 0 and gpu_amount(conf, "driver" if local_master else "executor") <= 0:
        key = "spark.driver.resource.gpu.amount" if local_master else "spark.executor.resource.gpu.amount"
        why = (f"resources['gpus']={gpus:g}" if asked is not None and asked.gpus else "use_gpu=True")
        raise ClusterConfigError(
            f"{why} asks for {gpus:g} GPU(s) per rank, but {key} is not set, so the "
            f"{'driver' if local_master else 'executors'} offer no GPUs. Start the application with GPU "
            f"executors ({key} and a GPU discovery script; see conf/ and docs/resources.md), or pass "
            "use_gpu=False")
    if local_master:
        raise ClusterConfigError(
            f"this run's ranks would need their own task resources (cpus={cpus}, gpus={gpus:g} per rank, while "
            f"the application's tasks get cpus={default.cpus}, gpus={default.gpus:g}), and Spark's local[N] "
            "master does not schedule stages by resource profile. Set spark.task.cpus and "
            "spark.task.resource.gpu.amount for the session instead, or run on a cluster (standalone, YARN, "
            "Kubernetes; local-cluster for tests)")
    return wanted


def profile_unsupported(map_in_arrow: Callable, pyspark_version: str) -> str | None:
    """Why this pyspark cannot give a run's barrier stage task resources of its own; None when it can.

    sparktrain asks for them through ``mapInArrow(..., profile=...)`` (pyspark 4.0 on): the
    parameters of the session's own ``DataFrame.mapInArrow`` tell, not the version number.

    >>> def map_in_arrow(self, func, schema, barrier=False): ...
    >>> profile_unsupported(map_in_arrow, "3.5.2")
    "pyspark 3.5.2's DataFrame.mapInArrow(func, schema, barrier) takes no profile= (it came in pyspark 4.0)"
    """
    import inspect

    try:
        params = [p for p in inspect.signature(map_in_arrow).parameters if p != "self"]
    except (TypeError, ValueError):
        return None  # no signature to read: let the call itself decide
    if "profile" in params:
        return None
    return (f"pyspark {pyspark_version}'s DataFrame.mapInArrow({', '.join(params)}) takes no profile= "
            "(it came in pyspark 4.0)")


def check_profile_support(map_in_arrow: Callable, pyspark_version: str) -> None:
    """Refuse, before anything launches, a run that needs its own task resources where the
    session's ``mapInArrow`` cannot ask for them (see :func:`profile_unsupported`)."""
    why = profile_unsupported(map_in_arrow, pyspark_version)
    if why is not None:
        raise ClusterConfigError(
            "this run needs its own task resources (resources=, or use_gpu=True where the application's tasks "
            f"ask for no GPU), which sparktrain requests through mapInArrow(..., profile=...), and {why}. "
            "Upgrade to pyspark 4.0 or later, or set spark.task.cpus and spark.task.resource.gpu.amount for the "
            "whole application and leave resources= out")


def check_capacity(required: int, cap: Capacity, use_gpu: bool) -> None:
    """Raise InsufficientResourcesError when ``cap`` cannot run ``required`` tasks at once."""
    available = cap.slots(use_gpu)
    if available >= required:
        return
    cpu = (f"{cap.executors} executor(s) x {cap.cores_per_executor} core(s) / {cap.cpus_label}={cap.task_cpus} "
           f"= {cap.cpu_slots} CPU slot(s)")
    gpu = (f"{cap.executors} executor(s) x {cap.gpus_per_executor:g} GPU(s) / "
           f"{cap.gpus_label}={cap.task_gpus:g} = {cap.gpu_slots} GPU slot(s)")
    if use_gpu and cap.gpu_slots < required and cap.gpu_slots <= cap.cpu_slots:
        limiting, detail = "GPUs", f"{gpu}; {cpu}"
        fix = (f"lower num_proc to {available}" if available else "add GPU executors") + \
            ", or add executors with GPUs (spark.executor.resource.gpu.amount)"
    elif cap.cpu_slots < required:
        limiting, detail = "CPU task slots", cpu + (f"; {gpu}" if use_gpu else "")
        fix = (f"lower num_proc to {available}" if available else
               "ask for fewer cpus per rank" if cap.profile and cap.executors else "start executors") + \
            ", or add executors or cores (spark.executor.instances, spark.executor.cores)"
    else:
        limiting, detail = "task slots", f"Spark reports {cap.spark_slots} concurrent task slot(s)"
        fix = f"lower num_proc to {available}, or add executors"
    raise InsufficientResourcesError(
        f"num_proc={required} needs {required} {'GPU ' if use_gpu else ''}task slots at once (barrier mode "
        f"gang-schedules every rank), but the cluster has {available}; limited by {limiting}: {detail}. "
        f"Fix: {fix}"
    )
