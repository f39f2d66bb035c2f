"""The driver's checks before anything launches: arguments, pickling, cluster conf, slot arithmetic.

Pure: no Spark imports (``sparktrain.driver.cluster`` asks Spark and hands the figures here).

Argument checks echo the bad value and say what to pass instead; the slot arithmetic says
what was required, what is available, which resource limits it, and the fix.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Callable, Iterable, Mapping

from .. import tracking, worker_env
from ..errors import (ClusterConfigError, InsufficientResourcesError, InvalidArgumentError,
                     PicklingFailedError)

#: Pickled train_fn + args + kwargs above this size get a warning: it travels with every task.
PICKLE_WARN_BYTES = 10 * 1024 * 1024

log = logging.getLogger("sparktrain")


def check_num_proc(num_proc: Any, local_mode: bool) -> tuple[int | None, bool]:
    """Validate ``num_proc``; returns ``(number of processes or None for "all slots", local_mode)``.

    A negative ``num_proc`` means local mode, as with HorovodRunner.
    """
    if not isinstance(local_mode, bool):
        raise InvalidArgumentError(f"local_mode must be True or False, got {local_mode!r}")
    if num_proc is None:
        if local_mode:
            raise InvalidArgumentError("num_proc is required with local_mode=True, for example num_proc=2")
        return None, False
    if isinstance(num_proc, bool) or not isinstance(num_proc, int):
        raise InvalidArgumentError(
            f"num_proc must be an int: the number of processes (negative for local mode), "
            f"got {num_proc!r} ({type(num_proc).__name__})"
        )
    if num_proc == 0:
        raise InvalidArgumentError(
            "num_proc must be a positive integer (or negative to run that many processes locally "
            "on the driver), got 0"
        )
    return abs(num_proc), local_mode or num_proc < 0


def check_arguments(train_fn, args, kwargs, env, stdout, stderr, verbose, prefix_output_with_timestamp,
                    use_gpu, output_ranks) -> tuple[tuple, dict, dict]:
    """Validate the rest of ``run``'s arguments; returns normalized (args, kwargs, env)."""
    if not callable(train_fn):
        raise InvalidArgumentError(
            f"train_fn must be a callable (the function each rank runs), got {train_fn!r} "
            f"({type(train_fn).__name__})"
        )
    if args is None:
        args = ()
    if not isinstance(args, (tuple, list)):
        raise InvalidArgumentError(
            f"args must be a tuple or list of positional arguments, got {type(args).__name__}: {args!r:.80}; "
            "for a single argument write args=(value,)"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise InvalidArgumentError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    bad_keys = [k for k in kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad_keys:
        raise InvalidArgumentError(f"kwargs keys must be identifier strings, got {bad_keys!r}")
    env = check_env(env)
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise InvalidArgumentError(f"{name} must be None or a writable text stream, got {stream!r}")
    if isinstance(verbose, bool) or not isinstance(verbose, int) or not 0 <= verbose <= 2:
        raise InvalidArgumentError(f"verbose must be 0, 1 or 2, got {verbose!r}")
    if not isinstance(prefix_output_with_timestamp, bool):
        raise InvalidArgumentError(
            f"prefix_output_with_timestamp must be True or False, got {prefix_output_with_timestamp!r}")
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise InvalidArgumentError(f"use_gpu must be True, False or None (decide from the Spark conf), got {use_gpu!r}")
    if output_ranks is not None and output_ranks != "all":
        ranks = [output_ranks] if isinstance(output_ranks, int) else output_ranks
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable) or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise InvalidArgumentError(
                f"output_ranks must be None or 'all', a rank, or a list of ranks such as [0], got {output_ranks!r}")
    return tuple(args), dict(kwargs), env


def normalize_output_ranks(output_ranks: Any, size: int) -> frozenset[int] | None:
    if output_ranks is None or output_ranks == "all":
        return None
    ranks = frozenset([output_ranks] if isinstance(output_ranks, int) else output_ranks)
    outside = sorted(r for r in ranks if r >= size)
    if outside:
        raise InvalidArgumentError(f"output_ranks {outside} are outside 0..{size - 1} for num_proc={size}")
    return ranks


def check_env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise InvalidArgumentError(f"env must be a dict of str to str, got {type(env).__name__}")
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        k, v = next(iter(bad.items()))
        shown = "a value" if isinstance(k, str) and tracking.is_secret(k) else repr(v)  # never a token
        raise InvalidArgumentError(
            f"env must map str to str; {k!r} maps to {shown} ({type(v).__name__}). Convert values with str()")
    reserved = sorted(set(env) & worker_env.RESERVED_VARS)
    if reserved:
        raise InvalidArgumentError(
            f"env sets {', '.join(reserved)}, which sparktrain sets for each rank; remove "
            f"{'it' if len(reserved) == 1 else 'them'} from env")
    return dict(env)


# -- pickling -----------------------------------------------------------------------------------

def _describe(obj: Any) -> str:
    t = type(obj)
    return f"a {t.__module__}.{t.__qualname__}"


def _is_spark_handle(obj: Any) -> bool:
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}
    return any(n.startswith("pyspark.") and n.rsplit(".", 1)[-1] in
               ("SparkSession", "SparkContext", "DataFrame", "RDD", "SQLContext", "Broadcast")
               for n in names)


def _suspects(train_fn, args, kwargs) -> Iterable[tuple[str, Any]]:
    name = getattr(train_fn, "__qualname__", repr(train_fn))
    code = getattr(train_fn, "__code__", None)
    if code is not None:
        for var, cell in zip(code.co_freevars, getattr(train_fn, "__closure__", None) or ()):
            try:
                yield f"the variable {var!r} captured by {name}", cell.cell_contents
            except ValueError:
                pass
        globs = getattr(train_fn, "__globals__", {})
        for var in code.co_names:
            if var in globs:
                yield f"the global {var!r} used by {name}", globs[var]
    for i, a in enumerate(args):
        yield f"args[{i}]", a
    for k, v in kwargs.items():
        yield f"kwargs[{k!r}]", v
    yield name, train_fn


def pickle_payload(train_fn: Callable, args: tuple, kwargs: dict, dumps: Callable[[Any], bytes]) -> bytes:
    """Pickle ``(train_fn, args, kwargs)``; on failure, name the object that cannot travel.

    A payload over :data:`PICKLE_WARN_BYTES` gets a ``ResourceWarning``: it travels with every task.
    """
    try:
        payload = dumps((train_fn, args, kwargs))
    except Exception as outer:  # noqa: BLE001 - pickling raises many types
        err = outer
    else:
        if len(payload) > PICKLE_WARN_BYTES:
            msg = (f"sparktrain: train_fn with its args pickles to {len(payload) / 2**20:.1f} MiB, which travels "
                   "with every task; load large data inside train_fn instead of capturing it")
            warnings.warn(msg, ResourceWarning, stacklevel=3)
            log.warning(msg)
        return payload
    for where, obj in _suspects(train_fn, args, kwargs):
        if _is_spark_handle(obj):
            raise PicklingFailedError(
                f"{where} is {_describe(obj)}, which cannot travel to executors: Spark objects live only "
                "on the driver. Create or read the data inside train_fn instead (for example from files), "
                "or pass plain Python/numpy values in args"
            ) from None
        try:
            dumps(obj)
        except Exception as e:  # noqa: BLE001
            raise PicklingFailedError(
                f"cannot pickle {where} ({_describe(obj)}): {type(e).__name__}: {e}. Create it inside "
                "train_fn instead of capturing it, or pass something picklable"
            ) from None
    raise PicklingFailedError(f"cannot pickle train_fn with its args and kwargs: {type(err).__name__}: {err}")


# -- cluster checks -----------------------------------------------------------------------------

def _conf_true(conf: Mapping[str, str], key: str) -> bool:
    return str(conf.get(key, "false")).strip().lower() == "true"


def check_cluster_conf(conf: Mapping[str, str], allow_unencrypted: bool) -> None:
    """Refuse settings barrier-mode training cannot work with."""
    if _conf_true(conf, "spark.dynamicAllocation.enabled"):
        raise ClusterConfigError(
            "spark.dynamicAllocation.enabled=true: barrier mode needs every rank running at once on a fixed "
            "set of executors, and Spark refuses barrier stages under dynamic allocation. Set "
            "spark.dynamicAllocation.enabled=false with a fixed spark.executor.instances for training"
        )
    if _conf_true(conf, "spark.ssl.enabled") and not allow_unencrypted:
        raise ClusterConfigError(
            "spark.ssl.enabled=true, but sparktrain's training traffic (collectives and the output channel) "
            "is not encrypted. Run on a trusted network and set spark.sparktrain.allowUnencrypted=true "
            "(or SPARKTRAIN_ALLOW_UNENCRYPTED=1) to go ahead"
        )


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
            "discovery script (see conf/ and README), or pass use_gpu=False"
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
            f"executors ({key} and a GPU discovery script; see conf/ and README, 'Resources per run'), or pass "
            "use_gpu=False")
    if local_master:
        raise ClusterConfigError(
            f"this run's ranks would need their own task resources (cpus={cpus}, gpus={gpus:g} per rank, while "
            f"the application's tasks get cpus={default.cpus}, gpus={default.gpus:g}), and Spark's local[N] "
            "master does not schedule stages by resource profile. Set spark.task.cpus and "
            "spark.task.resource.gpu.amount for the session instead, or run on a cluster (standalone, YARN, "
            "Kubernetes; local-cluster for tests)")
    return wanted


def check_profile_support(pyspark_version: str) -> None:
    """Stage-level task resources need ``mapInArrow(..., profile=...)``, new in pyspark 4.0."""
    import re

    major = int((re.findall(r"\d+", pyspark_version) or ["0"])[0])
    if major < 4:
        raise ClusterConfigError(
            f"this run needs its own task resources (resources=, or use_gpu=True where the application's tasks "
            f"ask for no GPU), which sparktrain requests through mapInArrow(..., profile=...), new in pyspark 4.0; "
            f"this is pyspark {pyspark_version}. Upgrade to pyspark 4.0 or later, or set spark.task.cpus and "
            "spark.task.resource.gpu.amount for the whole application and leave resources= out")


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
