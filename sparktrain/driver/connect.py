"""What the driver does differently on a Spark Connect session: no SparkContext, RDD or Py4J.

A Connect session (``SparkSession.builder.remote(...)``, an application started with
``spark.api.mode=connect``, or the pyspark-client package) is detected by its type. Everything
here is what a client can see or do:
- the conf, through ``spark.conf``;
- the capacity, counted from that conf (master, executor instances and cores), since the
  client cannot list executors; where the conf does not say, a probe: a job of ``num_proc``
  tasks that must all be running at once within the capacity wait;
- whether executors can open connections to this client, by a one-task probe, which decides
  how ranks meet: through the run's channel (live output) or Spark's barrier ``allGather``;
- a job's handle: a tag (``addTag``/``interruptTag``) in place of a job group.
"""
from __future__ import annotations

import logging
import re
import socket
from typing import Mapping

from . import cluster
from .preflight import Capacity, gpu_amount

log = logging.getLogger("sparktrain")

#: Seconds a probe task waits for its connection to this client.
PROBE_CONNECT_TIMEOUT = 3.0
#: Seconds the probe job may take in all (it waits for a free task slot first).
PROBE_JOB_TIMEOUT = 60.0

_SIZE = re.compile(r"(\d+)\s*([kmgtp]?)b?", re.IGNORECASE)


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (its class lives in ``pyspark.sql.connect``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def conf_of(spark) -> dict[str, str]:
    """The session's conf as the server reports it (a Connect client has no SparkConf)."""
    return {str(k): str(v) for k, v in dict(spark.conf.getAll).items()}


def size_bytes(text: str) -> int:
    """Spark's size notation in bytes: ``"1g"`` -> 1073741824; ``"0"`` -> 0 (no limit).

    >>> size_bytes("4m"), size_bytes("1024"), size_bytes("2G")
    (4194304, 1024, 2147483648)
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) << (10 * "bkmgtp".index((m.group(2) or "b").lower()))


def capacity(conf: Mapping[str, str]) -> Capacity | None:
    """The task slots the conf promises, or None when the conf does not say (dynamic allocation,
    or executors whose count is not configured)."""
    master = conf.get("spark.master", "")
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    task_gpus = gpu_amount(conf, "task")
    cores = cluster.local_cores(master)
    if cores is not None:
        return Capacity(1, cores, task_cpus, gpu_amount(conf, "driver"), task_gpus)
    shape = cluster.local_cluster_shape(master)
    if shape:
        return Capacity(shape[0], shape[1], task_cpus, gpu_amount(conf, "executor"), task_gpus)
    dynamic = conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true"
    instances, cores = conf.get("spark.executor.instances"), conf.get("spark.executor.cores")
    if dynamic or not instances or not cores:
        return None
    return Capacity(int(instances), int(cores), task_cpus, gpu_amount(conf, "executor"), task_gpus)


def register_profile(spark, profile) -> None:
    """Have the server create the run's ResourceProfile now, through ``spark``.

    pyspark creates a Connect profile on the server the first time its id is read, through the
    reading thread's active session; the stage is planned on the run's job thread, which has none
    (and a run may be started from a thread that has none either). The id, once read, stays with
    the profile.
    """
    local = getattr(type(spark), "_active_session", None)  # pyspark's per-thread active session
    previous = getattr(local, "session", None)
    if local is not None:
        local.session = spark
    try:
        profile.id  # noqa: B018 - reading it creates the profile on the server
    finally:
        if local is not None:
            local.session = previous


def client_host(spark) -> str:
    """This client's address on the route to the Connect server: where executors would reach it."""
    server = getattr(getattr(spark, "client", None), "host", None) or "localhost"
    if server in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((server, 15002))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


#: What the probe found, per session and client address: the network between executors and this
#: client does not change within a session, and a probe costs one Spark job (about 0.2 s).
_REACHED: dict[tuple[str, str], bool] = {}


def executors_reach(spark, host: str) -> bool:
    """Whether a task of this session can open a TCP connection to ``host`` (this client).

    One one-task job, which connects to a listener here; the kernel completes the handshake, so
    nothing needs to accept it. A job that does not finish in time counts as "cannot". Asked once
    per session and address.
    """
    key = (str(getattr(spark, "session_id", id(spark))), host)
    if key not in _REACHED:
        _REACHED[key] = _probe(spark, host)
    return _REACHED[key]


def _probe(spark, host: str) -> bool:
    from .jobs import BarrierJob

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        job = BarrierJob(spark, f"sparktrain-probe-{port}", "sparktrain: can executors reach the client?",
                         lambda: spark.range(0, 1, 1, 1).mapInArrow(_reach(host, port), "reached boolean").collect())
        job.start()
        if not job.wait(PROBE_JOB_TIMEOUT):
            job.cancel()
            return False
        return job.error is None and bool(job.rows) and bool(job.rows[0]["reached"])
    except OSError as e:
        log.debug("sparktrain: no probe listener on %s: %s", host, e)
        return False
    finally:
        listener.close()


def concurrent_slots(spark, host: str, wanted: int, wait: float) -> int:
    """How many of ``wanted`` tasks of one (non-barrier) job run at once within ``wait`` seconds.

    Each task connects to a listener here and holds its connection until this client closes it,
    so the count is of tasks running at the same moment, which is what a barrier stage needs.
    Stops counting at ``wanted``; the job is cancelled by its tag afterwards. Needs executors that
    can reach this client (see :func:`executors_reach`).
    """
    import time

    from .jobs import BarrierJob

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held: list[socket.socket] = []
    job = None
    try:
        listener.bind((host, 0))
        listener.listen(max(8, wanted))
        port = listener.getsockname()[1]
        job = BarrierJob(spark, f"sparktrain-slots-{port}", f"sparktrain: do {wanted} tasks run at once?",
                         lambda: spark.range(0, wanted, 1, wanted).mapInArrow(_hold(host, port, wait),
                                                                             "held boolean").collect())
        job.start()
        deadline = time.monotonic() + wait
        while len(held) < wanted and not job.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            listener.settimeout(min(left, 0.5))  # wake now and then to see whether the job failed
            try:
                held.append(listener.accept()[0])
            except socket.timeout:
                continue
        return len(held)
    finally:
        for s in held:
            s.close()  # lets every task finish
        listener.close()
        if job is not None and not job.wait(PROBE_CONNECT_TIMEOUT):
            job.cancel()


def _hold(host: str, port: int, wait: float):
    def hold(batches):
        import socket

        import pyarrow as pa

        for _ in batches:
            pass
        try:
            with socket.create_connection((host, port), timeout=PROBE_CONNECT_TIMEOUT) as s:
                s.settimeout(wait + PROBE_CONNECT_TIMEOUT)
                s.recv(1)  # the client closes it once it has counted, or gives up
            ok = True
        except OSError:
            ok = False
        yield pa.RecordBatch.from_arrays([pa.array([ok])], names=["held"])

    return hold


def _reach(host: str, port: int):
    def reach(batches):
        import socket

        import pyarrow as pa

        for _ in batches:
            pass
        try:
            socket.create_connection((host, port), timeout=PROBE_CONNECT_TIMEOUT).close()
            ok = True
        except OSError:
            ok = False
        yield pa.RecordBatch.from_arrays([pa.array([ok])], names=["reached"])

    return reach
