"""The driver's checks before anything launches: arguments, pickling, cluster conf, slot arithmetic.

Pure: no Spark imports (``sparktrain.driver.launch.cluster`` asks Spark and hands the figures here).

Argument checks echo the bad value and say what to pass instead; the slot arithmetic says
what was required, what is available, which resource limits it, and the fix.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Mapping

from ...seam import crypto, tracking, worker_env
from ... import settings
from ...errors import (ClusterConfigError, InvalidArgumentError,
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


def check_cluster_conf(conf: Mapping[str, str], allow_unencrypted: bool, encrypted: bool,
                       cpu_collectives: str) -> None:
    """Refuse settings barrier-mode training cannot work with, and training traffic in clear where
    Spark's own is encrypted. The values are the run's resolved settings (``driver.launch.config``):
    ``encrypted`` whether the run encrypts, ``cpu_collectives`` its CPU engine."""
    if _conf_true(conf, "spark.dynamicAllocation.enabled"):
        raise ClusterConfigError(
            "spark.dynamicAllocation.enabled=true: barrier mode needs every rank running at once on a fixed "
            "set of executors, and Spark refuses barrier stages under dynamic allocation. Set "
            "spark.dynamicAllocation.enabled=false with a fixed spark.executor.instances for training"
        )
    spark_on = settings.spark_encryption(conf)
    on = encrypted
    if spark_on and not on and not allow_unencrypted:
        raise ClusterConfigError(
            f"{spark_on[0]}=true, but sparktrain's encryption is off, so its training traffic (collectives and the "
            "output channel) would cross the network in clear. Set spark.sparktrain.encryption=auto or on "
            "(SPARKTRAIN_ENCRYPTION, run(encryption=...)), or, on a trusted network, "
            "spark.sparktrain.allowUnencrypted=true (or SPARKTRAIN_ALLOW_UNENCRYPTED=1) to go ahead in clear"
        )
    if on:
        why = crypto.unavailable()
        if why:
            raise ClusterConfigError(f"encryption is on (spark.sparktrain.encryption), but this driver cannot "
                                     f"encrypt: {why}; or set spark.sparktrain.encryption=off")
        if cpu_collectives == "tensorflow" and not allow_unencrypted:
            raise ClusterConfigError(
                "encryption is on, but cpu_collectives='tensorflow' moves gradients over TensorFlow's own ring, "
                "which sparktrain does not encrypt. Use cpu_collectives='native' (encrypted between hosts), or set "
                "spark.sparktrain.allowUnencrypted=true to accept that")
