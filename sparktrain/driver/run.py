"""The public ``sparktrain.run``: validate, pickle, resolve settings, then hand over to the attempts.

pyspark is imported inside the functions that need it, so ``import sparktrain`` stays fast
and works where only the worker API is used. The flow of a run, and which module does what,
is drawn in README.md ("Architecture").
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import IO, Any, Callable, Iterable, Mapping

from .. import settings, versions
from ..errors import ClusterConfigError, PicklingFailedError
from ..spec import TaskSpec
from . import cluster, preflight
from .attempt import RunInfo, run_attempts
from .jobs import LocalJob, SparkJob

log = logging.getLogger("sparktrain")

#: Seconds a retry waits at most for the cluster to offer every slot again (a lost executor's
#: replacement registers within seconds on standalone, YARN and Kubernetes).
RETRY_CAPACITY_WAIT = 60.0


def _configure_logging(verbose: int) -> None:
    log.setLevel({0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}[verbose])
    # A library should not configure logging, but a notebook user must see what run() says.
    # Attach a handler only when nobody configured one anywhere.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


def run(
    train_fn: Callable[..., Any],
    args: tuple | list = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    prefix_output_with_timestamp: bool = False,
    *,
    use_gpu: bool | None = None,
    local_mode: bool = False,
    timeout: float | None = None,
    output_ranks: int | Iterable[int] | str | None = None,
    checkpoint_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_attempts: int | None = None,
) -> Any:
    """Run ``train_fn(*args, **kwargs)`` on ``num_proc`` ranks at once and return rank 0's value.

    Each rank runs in a fresh Python process started by one task of a single barrier-mode
    Spark stage, with its rank, size and collective addresses in its environment (see the
    env contract in README.md). Output from every rank streams to this process as it happens.

    Parameters
    ----------
    train_fn : the function each rank runs. It and its arguments are pickled with cloudpickle.
    args, kwargs : positional and keyword arguments for ``train_fn``.
    num_proc : the number of ranks. None uses every task slot of the cluster. Negative runs
        ``-num_proc`` processes on the driver without Spark (local mode), as with HorovodRunner.
    start_timeout : seconds for every rank to start and check in (default 600; also
        ``SPARKTRAIN_START_TIMEOUT`` or ``spark.sparktrain.startTimeout``).
    env : extra environment variables for every rank.
    stdout, stderr : where ranks' output lines go (default ``sys.stdout``/``sys.stderr``).
    verbose : 0 warnings only, 1 progress (default), 2 debug.
    prefix_output_with_timestamp : put the time before each rank's output line.
    use_gpu : give each rank one GPU (pinned through ``CUDA_VISIBLE_DEVICES``). None (default)
        uses GPUs when ``spark.task.resource.gpu.amount`` is set.
    local_mode : run on the driver without Spark, like a negative ``num_proc``.
    timeout : seconds the whole run may take; None (default) is no limit.
    output_ranks : which ranks' output to show: None or "all" (default), a rank, or a list.
    checkpoint_url : send rank 0's value straight from its executor to this fsspec URL (abfs://,
        s3://, file://, ...), atomically and with a checksum, and return the URL. Rank 0 must return
        bytes or the path of a local file or directory. Use it for checkpoints larger than
        ``spark.driver.maxResultSize`` allows through Spark.
    storage_options : credentials and options for ``checkpoint_url``'s backend (see
        ``sparktrain.storage``); never logged.
    max_attempts : how many times to start the whole gang when an attempt fails (default 1;
        also ``SPARKTRAIN_MAX_ATTEMPTS`` or ``spark.sparktrain.maxAttempts``). Ranks read the
        attempt number with ``sparktrain.attempt()``; with ``sparktrain.keras.restore`` and
        ``RemoteCheckpoint`` a retried run resumes from its latest checkpoint. A cancelled or
        timed-out run, and failures that would recur (a result too large, mismatched versions),
        are not retried.

    Returns
    -------
    Whatever ``train_fn`` returned on rank 0, or ``checkpoint_url`` when it is given. (``horovod.spark.run`` returns a list of every
    rank's value; the other ranks' values are discarded here.)

    Raises
    ------
    InvalidArgumentError, PicklingFailedError, ClusterConfigError, InsufficientResourcesError
        before anything launches.
    RankFailedError
        when any rank fails; keyed by rank, root cause first, with remote tracebacks.
    StartTimeoutError, RunTimeoutError, RunCancelledError, ResultTooLargeError

    Examples
    --------
    >>> def train(lr, epochs=3):
    ...     import sparktrain
    ...     return f"rank {sparktrain.rank()} trained at {lr}"
    >>> sparktrain.run(train, args=(0.1,), kwargs={"epochs": 2}, num_proc=3)  # doctest: +SKIP
    'rank 0 trained at 0.1'
    """
    size, local = preflight.check_num_proc(num_proc, local_mode)
    args, kwargs, env = preflight.check_arguments(
        train_fn, args, kwargs, env, stdout, stderr, verbose, prefix_output_with_timestamp, use_gpu, output_ranks)
    start_timeout = settings.parse_seconds("start_timeout", start_timeout, allow_none=True)
    timeout = settings.parse_seconds("timeout", timeout, allow_none=True)
    if max_attempts is not None:
        max_attempts = settings.resolve("max_attempts", max_attempts)
    _configure_logging(verbose)
    import cloudpickle

    checkpoint = None
    if checkpoint_url is not None:
        from .. import storage

        storage.check_url(checkpoint_url, storage_options)  # an unknown scheme or missing backend fails here
        try:
            checkpoint = cloudpickle.dumps((checkpoint_url, dict(storage_options or {})))
        except Exception as e:  # noqa: BLE001
            raise PicklingFailedError(f"cannot pickle storage_options for {checkpoint_url!r}: {type(e).__name__}") \
                from None

    fn_name = getattr(train_fn, "__qualname__", type(train_fn).__name__)
    info = RunInfo(run_id=uuid.uuid4().hex[:12], fn_name=fn_name, stdout=stdout, stderr=stderr,
                   timestamps=prefix_output_with_timestamp, timeout=timeout, verbose=verbose)

    if local:
        conf: dict[str, str] = {}
        output = preflight.normalize_output_ranks(output_ranks, size)
        spec = _task_spec(info, size=size, payload=preflight.pickle_payload(train_fn, args, kwargs, cloudpickle.dumps),
                          driver_address=("127.0.0.1", 0), use_gpu=bool(use_gpu), output_ranks=output, max_result_bytes=0,
                          env=env, conf=conf, checkpoint=checkpoint, start_timeout=start_timeout)
        gpus = cluster.local_gpus(size) if use_gpu else None
        return run_attempts(info, spec, lambda s, on_done: LocalJob(s, gpus, on_done), "127.0.0.1",
                            settings.resolve("max_attempts", max_attempts, conf=conf))

    spark = cluster.active_session()
    if spark is None:
        master = f"local[{size or os.cpu_count() or 1}]"
        spark = cluster.start_session(master)
        log.info("sparktrain: no active SparkSession; started an embedded %s session", master)
    try:
        sc = spark.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect raises its own not-implemented error
        raise ClusterConfigError(
            "this SparkSession has no SparkContext (a Spark Connect session?); sparktrain.run needs a classic "
            "session for now. Run it where the driver has a SparkContext, or use local_mode=True") from None
    conf = dict(sc.getConf().getAll())
    preflight.check_cluster_conf(conf, settings.resolve("allow_unencrypted", conf=conf))
    cluster.check_executors_python(sc)
    if use_gpu is None:
        use_gpu = preflight.gpu_amount(conf) > 0
    preflight.check_gpu_conf(conf, use_gpu)
    if size is None:
        size = max(1, cluster.capacity(sc, conf).slots(use_gpu))
    capacity_wait = settings.resolve("capacity_wait", conf=conf)
    cluster.wait_for_capacity(sc, conf, size, use_gpu, capacity_wait)
    rendezvous = settings.resolve("rendezvous", conf=conf)
    driver_host = conf.get("spark.driver.host", "127.0.0.1")
    max_result = int(sc._jsc.sc().conf().getSizeAsBytes("spark.driver.maxResultSize", "1g"))
    output = preflight.normalize_output_ranks(output_ranks, size)
    spec = _task_spec(info, size=size, payload=preflight.pickle_payload(train_fn, args, kwargs, cloudpickle.dumps),
                      driver_address=(driver_host, 0) if rendezvous != "barrier" else None, use_gpu=use_gpu,
                      output_ranks=output, max_result_bytes=max_result,
                      env=env, conf=conf, checkpoint=checkpoint, start_timeout=start_timeout,
                      spill_url=_spill_url(sc.master, conf))
    max_attempts = settings.resolve("max_attempts", max_attempts, conf=conf)
    log.debug("sparktrain: run %s resolved settings: num_proc=%d use_gpu=%s start_timeout=%s timeout=%s "
              "rendezvous=%s grace_period=%s maxResultSize=%d max_attempts=%d capacity_wait=%s spill_url=%s",
              info.run_id, size, use_gpu, spec.start_timeout, timeout, rendezvous, spec.grace_period, max_result,
              max_attempts, capacity_wait, spec.spill_url)

    def before_retry() -> None:
        # A lost executor is usually replaced within seconds; the gang needs all its slots back.
        cluster.wait_for_capacity(sc, conf, size, use_gpu, max(RETRY_CAPACITY_WAIT, capacity_wait))

    return run_attempts(info, spec, lambda s, on_done: SparkJob(spark, s, fn_name, on_done), driver_host,
                        max_attempts, before_retry)


def _task_spec(info: RunInfo, *, size: int, payload: bytes, driver_address: tuple[str, int] | None, use_gpu: bool,
               output_ranks: frozenset[int] | None, max_result_bytes: int, env: Mapping[str, str],
               conf: Mapping[str, str], checkpoint: bytes | None, start_timeout: float | None,
               spill_url: str | None = None) -> TaskSpec:
    """The spec every rank of every attempt gets; each attempt adds its number and its channel's secret."""
    return TaskSpec(
        run_id=info.run_id, size=size, payload=payload, secret=b"", driver_address=driver_address,
        use_gpu=use_gpu, output_ranks=output_ranks, max_result_bytes=max_result_bytes,
        start_timeout=settings.resolve("start_timeout", start_timeout, conf=conf),
        grace_period=settings.resolve("grace_period", conf=conf), user_env=settings.rank_env(env, conf), checkpoint=checkpoint,
        spill_url=spill_url, versions=versions.collect(), tf_log_level=0 if info.verbose == 2 else 2,
    )


def _spill_url(master: str, conf: Mapping[str, str]) -> str | None:
    """Where rank 0 spills a value too large for Spark's result path; None: it fails instead."""
    url = settings.resolve("spill_url", conf=conf)
    if url == "":
        return None  # spilling turned off
    if url is None and cluster.on_this_host(master):
        # Executors and driver share this machine's disk.
        import tempfile

        url = "file://" + os.path.join(tempfile.gettempdir(), "sparktrain-spill")
    if url is not None:
        from .. import storage

        storage.check_url(url)
    return url
