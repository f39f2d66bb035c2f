"""Driver side of ``sparktrain.run``: validate, preflight, launch one barrier stage, supervise, collect.

pyspark is imported inside the functions that need it, so ``import sparktrain`` stays fast
and works where only the worker API is used.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import posixpath
import queue
import re
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Iterable, Mapping

from . import logstream, preflight, settings, versions
from .errors import (ClusterConfigError, InsufficientResourcesError, PicklingFailedError, RankFailedError,
                     RankFailure, RunCancelledError,
                     RunTimeoutError, SparkTrainError, StartTimeoutError, failures_in)
from .spec import TaskSpec
from .task import SPILLED

log = logging.getLogger("sparktrain")

#: Seconds a retry waits at most for the cluster to offer every slot again (a lost executor's
#: replacement registers within seconds on standalone, YARN and Kubernetes).
RETRY_CAPACITY_WAIT = 60.0

#: Arrow schema of what the barrier stage returns: rank 0's pickled result, in chunks.
RESULT_SCHEMA = "rank int, seq int, data binary"


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
    stdout=None,
    stderr=None,
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
        from . import storage

        storage.check_url(checkpoint_url, storage_options)  # an unknown scheme or missing backend fails here
        try:
            checkpoint = cloudpickle.dumps((checkpoint_url, dict(storage_options or {})))
        except Exception as e:  # noqa: BLE001
            raise PicklingFailedError(f"cannot pickle storage_options for {checkpoint_url!r}: {type(e).__name__}") \
                from None

    fn_name = getattr(train_fn, "__qualname__", type(train_fn).__name__)
    run = _Run(run_id=uuid.uuid4().hex[:12], fn_name=fn_name, stdout=stdout, stderr=stderr,
               timestamps=prefix_output_with_timestamp, timeout=timeout)

    if local:
        output = preflight.normalize_output_ranks(output_ranks, size)
        payload = _pickle(train_fn, args, kwargs, cloudpickle)
        conf: dict[str, str] = {}
        spec = run.spec(size, payload, ("127.0.0.1", 0), bool(use_gpu), output, 0, env, conf, checkpoint,
                        settings.resolve("start_timeout", start_timeout, conf=conf))
        gpus = _local_gpus(size) if use_gpu else None
        return run.attempts(lambda s: _LocalJob(s, gpus), spec, "127.0.0.1",
                            settings.resolve("max_attempts", max_attempts, conf=conf))

    spark = _session(size)
    try:
        sc = spark.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect raises its own not-implemented error
        raise ClusterConfigError(
            "this SparkSession has no SparkContext (a Spark Connect session?); sparktrain.run needs a classic "
            "session for now. Run it where the driver has a SparkContext, or use local_mode=True") from None
    conf = dict(sc.getConf().getAll())
    preflight.check_cluster_conf(conf, settings.resolve("allow_unencrypted", conf=conf))
    if use_gpu is None:
        use_gpu = float(conf.get("spark.task.resource.gpu.amount", "0") or 0) > 0
    preflight.check_gpu_conf(conf, use_gpu)
    if size is None:
        size = max(1, _capacity(sc, conf).slots(use_gpu))
    capacity_wait = settings.resolve("capacity_wait", conf=conf)
    _wait_for_capacity(sc, conf, size, use_gpu, capacity_wait)
    output = preflight.normalize_output_ranks(output_ranks, size)
    payload = _pickle(train_fn, args, kwargs, cloudpickle)
    rendezvous = settings.resolve("rendezvous", conf=conf)
    driver_host = conf.get("spark.driver.host", "127.0.0.1")
    max_result = int(sc._jsc.sc().conf().getSizeAsBytes("spark.driver.maxResultSize", "1g"))
    spec = run.spec(size, payload, (driver_host, 0) if rendezvous != "barrier" else None, use_gpu, output,
                    max_result, env, conf, checkpoint, settings.resolve("start_timeout", start_timeout, conf=conf))
    spec = dataclasses.replace(spec, spill_url=_spill_url(sc.master, conf))
    max_attempts = settings.resolve("max_attempts", max_attempts, conf=conf)
    log.debug("sparktrain: run %s resolved settings: num_proc=%d use_gpu=%s start_timeout=%s timeout=%s "
              "rendezvous=%s grace_period=%s maxResultSize=%d max_attempts=%d", run.run_id, size, use_gpu,
              spec.start_timeout, timeout, rendezvous, spec.grace_period, max_result, max_attempts)
    def before_retry():
        # A lost executor is usually replaced within seconds; the gang needs all its slots back.
        _wait_for_capacity(sc, conf, size, use_gpu, max(RETRY_CAPACITY_WAIT, capacity_wait))

    return run.attempts(lambda s: _SparkJob(spark, s, fn_name), spec, driver_host, max_attempts, before_retry)


def _spill_url(master: str, conf: Mapping[str, str]) -> str | None:
    """Where rank 0 spills a value too large for Spark's result path; None: it fails instead."""
    url = settings.resolve("spill_url", conf=conf)
    if url == "":
        return None  # spilling turned off
    if url is None and (master == "local" or master.startswith(("local[", "local-cluster["))):
        # Executors and driver share this machine's disk.
        import tempfile

        url = "file://" + os.path.join(tempfile.gettempdir(), "sparktrain-spill")
    if url is not None:
        from . import storage

        storage.check_url(url)
    return url


def _load_result(data: bytes | None, cloudpickle) -> Any:
    """Rank 0's value from the bytes Spark carried, or from storage where rank 0 spilled it."""
    if not data:
        return None
    if not data.startswith(SPILLED):
        return cloudpickle.loads(data)
    import tempfile

    from . import storage

    url = data[len(SPILLED):].decode()
    log.info("sparktrain: rank 0's value was too large for spark.driver.maxResultSize; reading it from %s", url)
    try:
        with tempfile.TemporaryDirectory(prefix="sparktrain-result-") as tmp:
            local = storage.get_file(url, os.path.join(tmp, "result.pkl"))
            with open(local, "rb") as f:
                return cloudpickle.load(f)
    finally:
        try:
            fs, path = storage.filesystem(url)
            fs.rm(posixpath.dirname(path), recursive=True)
        except Exception as e:  # noqa: BLE001 - the value is safe; say what is left behind
            log.warning("sparktrain: could not delete the spilled result under %s: %s", url, e)


def _pickle(train_fn, args, kwargs, cloudpickle) -> bytes:
    payload = preflight.pickle_payload(train_fn, args, kwargs, cloudpickle.dumps)
    if len(payload) > preflight.PICKLE_WARN_BYTES:
        msg = (f"sparktrain: train_fn with its args pickles to {len(payload) / 2**20:.1f} MiB, which travels "
               "with every task; load large data inside train_fn instead of capturing it")
        warnings.warn(msg, ResourceWarning, stacklevel=3)
        log.warning(msg)
    return payload


def _session(num_proc: int | None):
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        spark = getattr(SparkSession, "_instantiatedSession", None)
    if spark is not None:
        return spark
    master = f"local[{num_proc or os.cpu_count() or 1}]"
    if not os.environ.get("PYSPARK_PYTHON"):
        # The embedded executors must run this interpreter, where sparktrain and the user's
        # packages are; pyspark reads only this variable to choose the workers' Python.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    # Ranks' output streams to this console; Spark's progress bar would cut through it.
    spark = (SparkSession.builder.master(master).appName("sparktrain")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    _quiet_task_failures(spark)
    log.info("sparktrain: no active SparkSession; started an embedded %s session", master)
    return spark


def _quiet_task_failures(spark) -> None:
    """In the session sparktrain started itself, Spark need not log each failed rank's task.

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


def _capacity(sc, conf: Mapping[str, str]) -> preflight.Capacity:
    """Ask Spark what the cluster offers one barrier stage right now."""
    jsc = sc._jsc.sc()
    master = sc.master
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    task_gpus = float(conf.get("spark.task.resource.gpu.amount", "0") or 0)
    spark_slots = None
    try:
        spark_slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal API; fall back to arithmetic from the conf
        pass
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
    if m:
        cores = os.cpu_count() if m.group(1) in (None, "*") else int(m.group(1))
        if m.group(1) is None:
            cores = 1
        return preflight.Capacity(1, cores, task_cpus, float(conf.get("spark.driver.resource.gpu.amount", "0")),
                                  task_gpus, spark_slots)
    executors = max(0, jsc.getExecutorMemoryStatus().size() - 1)  # minus the driver
    m = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*(\d+)\]", master)
    cores = int(m.group(2)) if m else int(conf.get("spark.executor.cores", "0") or 0)
    if not cores and executors:
        cores = max(1, (spark_slots or 0) * task_cpus // executors)
    return preflight.Capacity(executors, cores, task_cpus, float(conf.get("spark.executor.resource.gpu.amount", "0")),
                              task_gpus, spark_slots)


def _expected_executors(master: str, conf: Mapping[str, str]) -> int | None:
    m = re.fullmatch(r"local-cluster\[(\d+),\s*\d+,\s*\d+\]", master)
    if m:
        return int(m.group(1))
    if conf.get("spark.executor.instances"):
        return int(conf["spark.executor.instances"])
    return None


def _wait_for_capacity(sc, conf, size: int, use_gpu: bool, wait: float) -> None:
    """Fail within seconds when the cluster cannot run every rank at once.

    Spark's own barrier check retries for about 10 minutes. sparktrain decides at once when it
    knows how many executors to expect (local masters, local-cluster, spark.executor.instances)
    and they are all registered, or when even all of them would be too few. Only executors that
    are still registering get up to ``wait`` seconds.
    """
    cap = _capacity(sc, conf)
    expected = 1 if sc.master.startswith("local[") or sc.master == "local" else _expected_executors(sc.master, conf)
    if expected is not None and cap.executors < expected and cap.cores_per_executor:
        preflight.check_capacity(size, dataclasses.replace(cap, executors=expected, spark_slots=None), use_gpu)
    deadline = time.monotonic() + (0 if expected is not None and cap.executors >= expected else wait)
    while True:
        try:
            preflight.check_capacity(size, cap, use_gpu)
            return
        except InsufficientResourcesError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.2)  # executors register with no event the driver's Python side can await
        cap = _capacity(sc, conf)


def _local_gpus(size: int) -> list[list[str]]:
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


# -- jobs: the thing the driver waits on ---------------------------------------------------------

class _Job:
    """What the driver waits on: it runs in the background and says when it is done."""

    def __init__(self, spec):
        self.spec = spec
        self.error: BaseException | None = None
        #: Called once, from the job's own thread, when it ends.
        self.on_done: Callable[[], None] = lambda: None
        self._done = threading.Event()

    def _finish(self) -> None:
        self._done.set()
        self.on_done()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class _SparkJob(_Job):
    """One barrier stage of ``size`` tasks, collected on a background thread."""

    def __init__(self, spark, spec, fn_name: str):
        super().__init__(spec)
        self.spark = spark
        self.group = f"sparktrain-{spec.run_id}"
        self.description = f"sparktrain.run({fn_name}) num_proc={spec.size} run {spec.run_id}"
        self.rows = None
        self._thread = threading.Thread(target=self._collect, name=f"sparktrain-job-{spec.run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _collect(self) -> None:
        try:
            sc = self.spark.sparkContext
            sc.setJobGroup(self.group, self.description, interruptOnCancel=True)
            df = self.spark.range(0, self.spec.size, 1, self.spec.size)
            self.rows = df.mapInArrow(_barrier_fn(self.spec), RESULT_SCHEMA, barrier=True).collect()
        except BaseException as e:  # noqa: BLE001 - handed to the supervising thread
            self.error = e
        finally:
            self._finish()

    def cancel(self) -> None:
        self.spark.sparkContext.cancelJobGroup(self.group)

    def result_bytes(self) -> bytes | None:
        chunks = sorted((r["seq"], r["data"]) for r in self.rows if r["rank"] == 0)
        return b"".join(bytes(d) for _, d in chunks) if chunks else None


def _barrier_fn(spec):
    """The function each barrier task runs; it is pickled with ``spec`` inside."""

    def barrier_task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from sparktrain.task import run_rank

        for _ in batches:  # the input is one row per task; only the partition id matters
            pass
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        if ctx.attemptNumber() > 0:
            raise RuntimeError(f"sparktrain rank {rank}: Spark retried this task; a rank is never re-run alone, "
                               "so this attempt stops")
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        gpu = ctx.resources().get("gpu")
        for seq, chunk in enumerate(run_rank(spec, rank, host, gpu.addresses if gpu else [], ctx)):
            yield pa.RecordBatch.from_arrays(
                [pa.array([rank], pa.int32()), pa.array([seq], pa.int32()), pa.array([chunk], pa.binary())],
                names=["rank", "seq", "data"])

    return barrier_task


class _LocalJob(_Job):
    """Local mode: each rank's executor-side code runs on a driver thread; no Spark."""

    def __init__(self, spec, gpus: list[list[str]] | None):
        super().__init__(spec)
        self.gpus = gpus
        self.errors: dict[int, BaseException] = {}
        self.chunks: list[bytes] = []
        self._threads = [threading.Thread(target=self._rank, args=(r,), name=f"sparktrain-local-{r}", daemon=True)
                         for r in range(spec.size)]
        self._left = spec.size
        self._lock = threading.Lock()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _rank(self, rank: int) -> None:
        from .task import run_rank

        try:
            chunks = list(run_rank(self.spec, rank, "127.0.0.1", self.gpus[rank] if self.gpus else None))
            if rank == 0:
                self.chunks = chunks
        except BaseException as e:  # noqa: BLE001
            self.errors[rank] = e
        finally:
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    if self.errors:
                        self.error = self.errors[min(self.errors)]
                    self._finish()

    def cancel(self) -> None:
        pass  # the ranks stop when the channel tells them to, or when the channel closes

    def result_bytes(self) -> bytes | None:
        return b"".join(self.chunks) if self.chunks else None


# -- supervision ---------------------------------------------------------------------------------

class _Run:
    """One call of ``run``: what every attempt shares, and the loop over attempts."""

    def __init__(self, *, run_id, fn_name, stdout, stderr, timestamps, timeout):
        self.run_id = run_id
        self.fn_name = fn_name
        self.stdout = stdout
        self.stderr = stderr
        self.timestamps = timestamps
        self.timeout = timeout
        self.started = time.monotonic()

    def spec(self, size, payload, driver_address, use_gpu, output, max_result, env, conf, checkpoint, start_timeout):
        return TaskSpec(
            run_id=self.run_id, size=size, payload=payload, secret=b"", driver_address=driver_address,
            use_gpu=use_gpu, output_ranks=output, max_result_bytes=max_result, start_timeout=start_timeout,
            grace_period=settings.resolve("grace_period", conf=conf), user_env=env, checkpoint=checkpoint,
            versions=versions.collect(),
        )

    def attempts(self, make_job: Callable[[TaskSpec], "_Job"], spec: TaskSpec, host: str, max_attempts: int,
                 before_retry: Callable[[], None] = lambda: None) -> Any:
        """Run the gang up to ``max_attempts`` times; every retry is logged, and counted in the final error."""
        earlier: list[str] = []
        for attempt in range(1, max_attempts + 1):
            if attempt > 1:
                before_retry()
            remaining = None if self.timeout is None else self.timeout - (time.monotonic() - self.started)
            launch = _Launch(self, attempt, max_attempts, remaining)
            try:
                value = launch.supervise(make_job(dataclasses.replace(spec, secret=launch.secret, attempt=attempt)),
                                         host, spec.size)
            except SparkTrainError as e:
                out_of_time = self.timeout is not None and time.monotonic() - self.started >= self.timeout
                if attempt == max_attempts or out_of_time or not _worth_retrying(e):
                    if attempt == 1:
                        raise
                    raise _with_attempts(e, attempt, earlier) from e
                earlier.append(_first_line(str(e)))
                log.warning("sparktrain: run %s attempt %d of %d failed: %s; starting all %d ranks again",
                            self.run_id, attempt, max_attempts, earlier[-1], spec.size)
                continue
            if attempt > 1:
                log.warning("sparktrain: run %s succeeded on attempt %d of %d, after %d failed attempt(s)",
                            self.run_id, attempt, max_attempts, attempt - 1)
            return value
        raise AssertionError("unreachable")


def _worth_retrying(e: SparkTrainError) -> bool:
    """Failures that another attempt could fix; not ones the user asked for or that would recur."""
    if isinstance(e, (RunCancelledError, RunTimeoutError)):
        return False
    if isinstance(e, RankFailedError):
        return not e.root_cause.exc_type.endswith(("ResultTooLargeError", "VersionMismatchError"))
    return True


def _with_attempts(e: SparkTrainError, attempt: int, earlier: list[str]) -> SparkTrainError:
    if isinstance(e, RankFailedError):
        return RankFailedError(e.failures, attempts=attempt, earlier=earlier)
    history = "; ".join(f"attempt {i}: {why}" for i, why in enumerate(earlier, 1))
    return type(e)(f"{e} (attempt {attempt} of {attempt}; earlier attempts failed: {history})")


class _Launch:
    """One attempt: its own secret, channel and Spark job, supervised until it ends."""

    def __init__(self, run: _Run, attempt: int, max_attempts: int, timeout: float | None):
        self.run = run
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.secret = logstream.new_secret()
        self.server: logstream.DriverServer | None = None

    def _write(self, rank: int, stream: str, line: str, when: float) -> None:
        out = (self.run.stderr or sys.stderr) if stream == "stderr" else (self.run.stdout or sys.stdout)
        prefix = f"[{rank}]<{stream}>:"
        if self.run.timestamps:
            prefix = datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " " + prefix
        try:
            out.write(prefix + line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass  # a closed stream must not stop training

    def supervise(self, job, host: str, size: int) -> Any:
        """Start ``job`` and watch it until it ends; return rank 0's value or raise one error."""
        import cloudpickle

        self.size = size
        self.start_timeout = job.spec.start_timeout
        self.started = time.monotonic()
        self.hosts: dict[int, str] = {}
        self.start_seconds: float | None = None
        self.failures: dict[int, RankFailure] = {}
        self.all_started = False
        self.said_hello: set[int] = set()
        self.disconnected: set[int] = set()
        if job.spec.driver_address is not None:
            self.server = logstream.DriverServer(self.secret, size, host)
            job.spec = _with_address(job.spec, self.server.address)
            events = self.server.events
            job.on_done = lambda: events.put(("job done",))  # wakes the loop below at once
        stopping: SparkTrainError | None = None
        try:
            job.start()
            of = f" (attempt {self.attempt} of {self.max_attempts})" if self.max_attempts > 1 else ""
            log.info("sparktrain: launching %d rank(s) of %s, run %s%s", size, self.run.fn_name, self.run.run_id, of)
            while not job.done():
                self._handle(self._next_event(job))
                elapsed = time.monotonic() - self.started
                if stopping is not None:
                    continue
                if self.failures:
                    stopping = RankFailedError(self.failures)
                    self._stop(job, f"rank {stopping.root_cause.rank} failed")
                elif self.server and not self.all_started and elapsed > self.start_timeout:
                    missing = self.server.missing_ranks()
                    stopping = StartTimeoutError(
                        f"timed out after {self.start_timeout:.0f} s waiting for rank(s) {missing} to start "
                        f"({size - len(missing)} of {size} checked in). Each rank needs one task slot at the "
                        "same time; check the Spark UI for stuck tasks, or raise start_timeout")
                    self._stop(job, "start_timeout expired")
                elif self.timeout is not None and elapsed > self.timeout:
                    stopping = RunTimeoutError(
                        f"run {self.run.run_id} of {self.run.fn_name} took longer than timeout={self.run.timeout:g} s and was "
                        "stopped; raise timeout or pass timeout=None for no limit")
                    self._stop(job, "timeout expired")
            if job.error is not None and stopping is None:
                # The Spark job ended under the ranks (cancelled, or a task lost): tell the ranks
                # now, so their processes end at once.
                self._stop(job, "the run's Spark job ended")
            self._drain()
        except BaseException:
            # KeyboardInterrupt (a notebook's stop button) or any driver-side error: stop everything.
            self._stop(job, "the driver was interrupted")
            raise
        finally:
            if self.server is not None:
                self.server.close()

        if self.failures:
            raise RankFailedError(self.failures)
        if stopping is not None:
            raise stopping
        if job.error is not None:
            reported = failures_in(str(job.error))
            if reported:
                raise RankFailedError(reported)
            text = str(job.error)
            if "cancel" in text.lower():
                raise RunCancelledError(
                    f"run {self.run.run_id} of {self.run.fn_name} was cancelled (Spark job group sparktrain-{self.run.run_id})"
                ) from job.error
            reason = _spark_reason(text)
            task = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", text)
            if task and int(task.group(1)) in self.hosts:
                # The rank's task died under it (its Python worker or executor was killed) before
                # sparktrain could report anything: name the rank, and what Spark saw.
                rank = int(task.group(1))
                raise RankFailedError([RankFailure(
                    rank=rank, host=self.hosts[rank], time=time.time(),
                    local_rank=sum(1 for r, h in self.hosts.items() if r < rank and h == self.hosts[rank]),
                    message=f"its Spark task died without a report from the rank (the executor's Python worker or "
                            f"JVM was killed, or ran out of memory); Spark says: {reason}")]) from job.error
            raise SparkTrainError(f"run {self.run.run_id} of {self.run.fn_name} failed in Spark: {reason}") from job.error
        data = job.result_bytes()
        value = _load_result(data, cloudpickle)
        if job.spec.checkpoint is not None:
            returned = f"checkpoint at {value}"
        else:
            returned = (f"{_size(len(data))} pickled" if data and not data.startswith(SPILLED) else
                        "a value spilled to storage" if data else "nothing")
        started = (f"ranks started in {self.start_seconds:.2f} s" if self.start_seconds is not None
                   else "ranks rendezvoused through Spark")
        log.info("sparktrain: run %s of %s finished in %.2f s (%s); rank 0 returned %s", self.run.run_id, self.run.fn_name,
                 time.monotonic() - self.run.started, started, returned)
        return value

    def _next_event(self, job):
        if self.server is None:
            job.wait(0.1)
            return None
        try:
            return self.server.events.get(timeout=0.1)
        except queue.Empty:
            return None

    def _handle(self, event) -> None:
        if event is None:
            return
        kind = event[0]
        if kind == "out":
            _, rank, stream, line, when = event
            self._write(rank, stream, line, when)
        elif kind == "failed":
            f = RankFailure.from_dict(event[2])
            self.failures.setdefault(f.rank, f)
        elif kind == "closed":
            self.disconnected.add(event[1])
        elif kind == "hello":
            self.said_hello.add(event[1])
            self.hosts[event[1]] = str(event[2].get("host", "?"))
            if self.all_started or len(self.said_hello) < self.size:
                return
            self.all_started = True
            self.start_seconds = time.monotonic() - self.started
            log.info("sparktrain: all %d rank(s) started in %.2f s on %s", self.size, self.start_seconds,
                     _placement(self.hosts))
        elif kind == "refused":
            log.warning("sparktrain: refused a connection from %s (%s)", event[1], event[2])

    def _drain(self) -> None:
        """Handle what ranks sent before they disconnected (their last output, failure reports)."""
        if self.server is None:
            return
        deadline = time.monotonic() + 5.0
        while True:
            waiting = self.said_hello - self.disconnected
            timeout = deadline - time.monotonic() if waiting else 0
            try:
                self._handle(self.server.events.get(timeout=max(0.0, timeout)) if timeout > 0
                             else self.server.events.get_nowait())
            except queue.Empty:
                return

    def _stop(self, job, reason: str) -> None:
        """Stop every rank: ask them (they terminate their process groups), then cancel the Spark job."""
        if self.server is not None:
            self.server.abort(reason)
            # Ranks stop their process groups within the grace period, then disconnect and end
            # their tasks; cancelling the Spark job first would kill them without that grace.
            deadline = time.monotonic() + job.spec.grace_period + 2.0
            # Wait for that even when the Spark job has already ended (cancelled, or a task lost):
            # Spark kills its tasks in its own time, and the ranks' processes may outlive that.
            # Each rank disconnects once its processes are gone; there is no single event to await.
            while self.server.connected_ranks() and time.monotonic() < deadline:
                time.sleep(0.05)
        # Cancel until the job ends: a cancel that lands before the job thread has submitted
        # its stage would otherwise be lost.
        deadline = time.monotonic() + 30.0
        while not job.done() and time.monotonic() < deadline:
            try:
                job.cancel()
            except Exception as e:  # noqa: BLE001
                log.warning("sparktrain: could not cancel the Spark job group: %s", e)
            job.wait(1.0)
        if not job.done():
            log.warning("sparktrain: the run's tasks did not end within 30 s of being cancelled")


def _placement(hosts: Mapping[int, str]) -> str:
    """``10.0.0.5 (ranks 0-1), 10.0.0.6 (rank 2)``: where the ranks run."""
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    parts = []
    for host, ranks in by_host.items():
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        which = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 f"ranks {ranks[0]}-{ranks[-1]}" if contiguous else "ranks " + ",".join(map(str, ranks)))
        parts.append(f"{host} ({which})")
    return ", ".join(parts)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def _with_address(spec, address):
    return dataclasses.replace(spec, driver_address=address)


def _spark_reason(text: str) -> str:
    """The informative part of a Spark job failure (py4j puts "An error occurred while calling" first)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("at ")]
    picked = []
    for line in lines:
        if "Job aborted due to stage failure:" in line:
            picked.append(line.split("Job aborted due to stage failure:", 1)[1].strip())
        elif picked and ("Exception:" in line or "Failure" in line) and len(picked) < 2:
            picked.append(line.split("Exception: ", 1)[-1])
    if not picked:
        picked = [line for line in lines if not line.startswith("An error occurred while calling")][:1] or lines[:1]
    return " ".join(picked)[:600]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
