"""The public ``sparktrain.run``: validate, pickle, resolve settings, then hand over to the attempts.

pyspark is imported inside the functions that need it, so ``import sparktrain`` stays fast
and works where only the worker API is used. The flow of a run, and which module does what,
is drawn in docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid
from typing import IO, Any, Callable, Iterable, Mapping

from .. import payload, settings
from ..errors import InsufficientResourcesError, InvalidArgumentError, PicklingFailedError
from . import capacity, cluster, connect, preflight
from .attempt import RunInfo, run_attempts
from .taskspec import task_spec as _task_spec
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
    data: Any = None,
    log_url: str | None = None,
    resources: Mapping[str, float] | None = None,
    nics: str | Iterable[str] | None = None,
    encryption: str | None = None,
) -> Any:
    """Run ``train_fn(*args, **kwargs)`` on ``num_proc`` ranks at once and return rank 0's value.

    Each rank runs in a fresh Python process started by one task of a single barrier-mode
    Spark stage, with its rank, size and collective addresses in its environment (see the
    env contract in docs/env-contract.md). Output from every rank streams to this process as it happens.

    Parameters
    ----------
    train_fn : the function each rank runs. It and its arguments are pickled with cloudpickle.
    args, kwargs : positional and keyword arguments for ``train_fn``.
    num_proc : the number of ranks. None uses every task slot of the cluster. Negative runs
        ``-num_proc`` processes on the driver without Spark (local mode), as with HorovodRunner.
    start_timeout : seconds for every rank to start and check in (default 600; also
        ``SPARKTRAIN_START_TIMEOUT`` or ``spark.sparktrain.startTimeout``).
    env : extra environment variables for every rank. When the driver has an active MLflow run (or
        ``MLFLOW_TRACKING_URI``/``MLFLOW_RUN_ID``), rank 0 also gets what it needs to log into that
        run, and the other ranks a throwaway store (``sparktrain.tracking``; see
        docs/tracking.md).
    stdout, stderr : where ranks' output lines go (default ``sys.stdout``/``sys.stderr``).
    verbose : 0 warnings only, 1 progress (default), 2 debug.
    prefix_output_with_timestamp : put the time before each rank's output line.
    use_gpu : give each rank one GPU (pinned through ``CUDA_VISIBLE_DEVICES``). None (default)
        uses GPUs when ``spark.task.resource.gpu.amount`` is set (or ``resources`` asks for GPUs).
        On an application whose tasks ask for no GPU but whose executors have GPUs
        (``spark.executor.resource.gpu.amount``), ``use_gpu=True`` asks for one GPU per rank
        for this run's stage alone, as ``resources={"gpus": 1}`` does.
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
    data : a Spark DataFrame, or a dict of them by name (``{"train": df, "val": val_df}``; a bare
        DataFrame is "train"), fed to the ranks: the rows travel through the run's barrier stage,
        each task spools its share to the executor's local disk, and ``train_fn`` reads it with
        ``sparktrain.data.dataset(...)``. Needs Spark ranks (not local mode). See docs/dataframes.md.
    log_url : an fsspec URL (a prefix) where every rank also writes its output, under
        ``sparktrain-<run id>/`` (also ``SPARKTRAIN_LOG_URL`` or ``spark.sparktrain.logUrl``);
        ``storage_options`` apply. When the ranks cannot reach this process (Spark Connect) the
        output is printed from there, about 2 s behind. See docs/connect.md.
    resources : what each rank's Spark task holds, for this run only: ``{"cpus": 4, "gpus": 1}``.
        ``cpus`` is a whole number of cores per rank, ``gpus`` GPUs per rank (a whole number, a
        fraction of at most 0.5 to share one, or 0). A key left out keeps the application's
        default (``spark.task.cpus``, ``spark.task.resource.gpu.amount``). The barrier stage asks
        for them through a Spark ResourceProfile (pyspark 4.0 or later; a standalone, YARN or
        Kubernetes cluster with dynamic allocation off), so the application's other stages keep
        their own resources. Each rank's compute threads (``OMP_NUM_THREADS``,
        ``TF_NUM_INTRAOP_THREADS``) follow its cpus unless ``env`` sets them. See docs/resources.md.
    nics : the network for the driver's channel and the ranks' ring, as Horovod's ``nics``:
        interface names or subnets (``"eth1"``, ``["10.1.0.0/16"]``); each host, the driver's
        included, uses its first address that matches (also ``SPARKTRAIN_NICS`` or
        ``spark.sparktrain.nics``). None: the addresses Spark knows the hosts by. See docs/run.md.
    encryption : "auto", "on" or "off": AES-256-GCM on the driver's channel and the native engine's
        ring between hosts, keys from the run's secret (also ``SPARKTRAIN_ENCRYPTION`` or
        ``spark.sparktrain.encryption``). "auto" (default) is on where Spark's own encryption is.
        See docs/security.md.

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
    asked = capacity.check_resources(resources, use_gpu)
    for name in settings.READ_IN_RANK:  # a bad value fails here, not in every rank
        settings.resolve(name, environ={**os.environ, **env})
    start_timeout = settings.parse_seconds("start_timeout", start_timeout, allow_none=True)
    timeout = settings.parse_seconds("timeout", timeout, allow_none=True)
    if max_attempts is not None:
        max_attempts = settings.resolve("max_attempts", max_attempts)
    if nics is not None:
        nics = settings.resolve("nics", nics)
    if encryption is not None:
        encryption = settings.resolve("encryption", encryption)
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
        if data is not None:
            raise InvalidArgumentError(
                "data= feeds a DataFrame through the run's Spark stage, and local mode runs without Spark. Use "
                "num_proc > 0 (on a local[N] master for one machine), or read the data inside train_fn")
        conf: dict[str, str] = {}
        if asked is not None and asked.gpus not in (None, 0.0, 1.0):
            raise InvalidArgumentError(
                f"local mode gives each rank one GPU of this machine, or none; resources['gpus']={resources['gpus']!r} "
                "cannot be met. Ask for 'gpus': 1 or 0, or run on Spark (num_proc > 0)")
        if asked is not None and asked.gpus:
            use_gpu = True
        output = preflight.normalize_output_ranks(output_ranks, size)
        spec = _task_spec(info, size=size, payload=preflight.pickle_payload(train_fn, args, kwargs, payload.dumps),
                          driver_address=("127.0.0.1", 0), use_gpu=bool(use_gpu), output_ranks=output, max_result_bytes=0,
                          env=env, conf=conf, checkpoint=checkpoint, start_timeout=start_timeout,
                          task_cpus=asked.cpus if asked is not None else None, encryption=encryption)
        gpus = cluster.local_gpus(size) if use_gpu else None
        return run_attempts(info, spec, lambda s, on_done: LocalJob(s, gpus, on_done), "127.0.0.1",
                            settings.resolve("max_attempts", max_attempts, conf=conf))

    spark = cluster.active_session()
    if spark is None:
        master = f"local[{size or os.cpu_count() or 1}]"
        spark = cluster.start_session(master)
        log.info("sparktrain: no active SparkSession; started an embedded %s session", master)
    frames = None
    if data is not None:
        from . import feed

        frames = feed.frames_of(data)
    connected = cluster.is_connect(spark)
    sc = None if connected else spark.sparkContext  # a Connect client has no SparkContext
    conf = connect.conf_of(spark) if connected else cluster.spark_conf(sc)
    master = conf.get("spark.master", "")
    preflight.check_cluster_conf(conf, settings.resolve("allow_unencrypted", conf=conf), encryption,
                                 {**os.environ, **env})
    rendezvous = settings.resolve("rendezvous", conf=conf)
    if sc is not None:
        cluster.check_executors_python(sc)
        driver_host = conf.get("spark.driver.host", "127.0.0.1")
    else:
        driver_host = connect.client_host(spark)
        # The probe that chooses the rendezvous reports the executors' Python too, once per session.
        connect.check_executors_python(spark, driver_host if rendezvous == "auto" else None)
    nics = settings.resolve("nics", nics, conf=conf)
    if nics:
        from .. import nics as networks

        driver_host = networks.own_address(nics, "the driver")
        log.info("sparktrain: nics=%s: the ranks reach this driver at %s", ",".join(nics), driver_host)
    if use_gpu is None:
        use_gpu = bool(asked.gpus) if asked is not None and asked.gpus is not None else capacity.gpu_amount(conf) > 0
    local_master = cluster.is_local(master)
    stage = capacity.stage_resources(conf, asked, use_gpu, local_master)
    profile = None
    if stage is not None:
        import pyspark

        capacity.check_profile_support(type(spark.range(0)).mapInArrow, pyspark.__version__)  # no job runs
        profile = cluster.task_profile(sc, stage)  # sc is None over Connect: the server registers it
        if connected:
            connect.register_profile(spark, profile)
        log.info("sparktrain: each rank's task asks for %d CPU(s) and %g GPU(s) through its own resource profile",
                 stage.cpus, stage.gpus)
    else:
        capacity.check_gpu_conf(conf, use_gpu)
    # A local master's task cpus are a count of slots, not of cores: threads follow only a cluster's.
    task_cpus = stage.cpus if stage is not None else \
        None if local_master else capacity.default_task_resources(conf).cpus
    capacity_wait = settings.resolve("capacity_wait", conf=conf)
    if connected:
        size = _check_connect_capacity(spark, conf, size, use_gpu, stage, capacity_wait)
    else:
        if size is None:
            size = max(1, cluster.capacity(sc, conf, stage, profile).slots(use_gpu))
        cluster.wait_for_capacity(sc, conf, size, use_gpu, capacity_wait, stage, profile)
    if connected:
        if rendezvous == "auto":
            reach = connect.executors_reach(spark, driver_host)
            rendezvous = "driver" if reach else "barrier"
            log.info("sparktrain: run %s over Spark Connect: executors %s this client at %s; ranks meet through %s",
                     info.run_id, "can reach" if reach else "cannot reach", driver_host,
                     "its channel, and their output streams here live" if reach else
                     "Spark's barrier allGather, and each rank's output tail comes back with the result or error")
        max_result = connect.size_bytes(conf.get("spark.driver.maxResultSize", "1g"))
    else:
        max_result = int(sc._jsc.sc().conf().getSizeAsBytes("spark.driver.maxResultSize", "1g"))
    log_target = _log_target(log_url, storage_options, conf)
    output = preflight.normalize_output_ranks(output_ranks, size)
    spec = _task_spec(info, size=size, payload=preflight.pickle_payload(train_fn, args, kwargs, payload.dumps),
                      driver_address=(driver_host, 0) if rendezvous != "barrier" else None, use_gpu=use_gpu,
                      output_ranks=output, max_result_bytes=max_result,
                      env=env, conf=conf, checkpoint=checkpoint, start_timeout=start_timeout,
                      spill_url=_spill_url(master, conf), feed=tuple(frames or ()),
                      return_output=connected and rendezvous == "barrier" and log_target is None,
                      log_target=log_target, task_cpus=task_cpus, nics=nics, encryption=encryption)
    source = None
    if frames:
        from . import feed

        source = feed.stage_input(frames, size)
    max_attempts = settings.resolve("max_attempts", max_attempts, conf=conf)
    log.debug("sparktrain: run %s resolved settings: num_proc=%d use_gpu=%s start_timeout=%s timeout=%s "
              "rendezvous=%s grace_period=%s maxResultSize=%d max_attempts=%d capacity_wait=%s spill_url=%s "
              "task_resources=%s task_cpus=%s",
              info.run_id, size, use_gpu, spec.start_timeout, timeout, rendezvous, spec.grace_period, max_result,
              max_attempts, capacity_wait, spec.spill_url, stage or "default profile", task_cpus)

    def before_retry() -> None:
        # A lost executor is usually replaced within seconds; the gang needs all its slots back.
        if connected:
            _check_connect_capacity(spark, conf, size, use_gpu, stage, max(RETRY_CAPACITY_WAIT, capacity_wait))
        else:
            cluster.wait_for_capacity(sc, conf, size, use_gpu, max(RETRY_CAPACITY_WAIT, capacity_wait), stage,
                                      profile)


    return run_attempts(info, spec, lambda s, on_done: SparkJob(spark, s, fn_name, on_done, source, profile), driver_host,
                        max_attempts, before_retry)


def _log_target(log_url: str | None, storage_options: Mapping[str, Any] | None,
                conf: Mapping[str, str]) -> bytes | None:
    """``(log_url, storage_options)`` pickled for the ranks, or None when no log_url is set."""
    url = settings.resolve("log_url", log_url, conf=conf)
    if not url:
        return None
    from .. import storage

    storage.check_url(url, storage_options)
    import cloudpickle

    return cloudpickle.dumps((url, dict(storage_options or {})))


def _check_connect_capacity(spark, conf: Mapping[str, str], size: int | None, use_gpu: bool,
                            stage: capacity.TaskResources | None = None, wait: float = 10.0) -> int:
    """Over Connect the client cannot list executors: count slots from the conf, or, where the
    conf does not say, probe with a job of ``size`` tasks that must all run at once within
    ``wait`` seconds. Fails now rather than wait out Spark's barrier slot check (about 10
    minutes). Returns the size. ``stage``: the run's own task resources, counted instead of the conf's."""
    cap = connect.capacity(conf)
    if cap is not None and stage is not None:
        cap = dataclasses.replace(cap, task_cpus=stage.cpus, task_gpus=stage.gpus or 0.0, profile=True)
    checked = (f"counted from the session's conf (spark.master={conf.get('spark.master', '?')}, "
               f"spark.executor.instances={conf.get('spark.executor.instances', 'unset')}, "
               f"spark.executor.cores={conf.get('spark.executor.cores', 'unset')}, "
               f"spark.task.cpus={conf.get('spark.task.cpus', '1')})")
    if cap is None:
        if size is None:
            raise InvalidArgumentError(
                "num_proc is required over Spark Connect when the conf does not say how many executors there "
                f"are (spark.executor.instances/cores unset); {checked}")
        host = connect.client_host(spark)
        if stage is not None or not connect.executors_reach(spark, host):
            log.info("sparktrain: over Spark Connect the task slots cannot be %s, nor probed from here; "
                     "launching %d ranks", checked, size)
            return size
        running = connect.concurrent_slots(spark, host, size, wait)
        if running < size:
            raise InsufficientResourcesError(
                f"num_proc={size} needs {size} task slots at once, but only {running} task(s) of a probe job of "
                f"{size} ran at once within {wait:g} s (the conf does not say: {checked}). Lower num_proc, add "
                "executors, or set spark.executor.instances and spark.executor.cores so the count comes from the "
                "conf; spark.sparktrain.capacityWait waits longer for executors to come up")
        log.info("sparktrain: %d tasks ran at once in a probe job (the conf does not say how many executors "
                 "there are)", running)
        return size
    if size is None:
        return max(1, cap.slots(use_gpu))
    try:
        capacity.check_capacity(size, cap, use_gpu)
    except InsufficientResourcesError as e:
        raise InsufficientResourcesError(f"{e} (slots {checked})") from None
    return size


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
