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
  the same probe reports the executors' Python, which must be this client's minor version and
  import what a rank's task needs (the check the classic path makes by running that Python);
- a job's handle: a tag (``addTag``/``interruptTag``) in place of a job group.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import socket
import sys
from typing import Mapping

from ...seam import versions
from ...errors import ClusterConfigError
from . import cluster, jobs
from . import probe as executor_probe
from .capacity import Capacity

log = logging.getLogger("sparktrain")

#: Seconds a probe task waits for its connection to this client.
PROBE_CONNECT_TIMEOUT = 3.0
#: Seconds the probe job may take in all (it waits for a free task slot first).
PROBE_JOB_TIMEOUT = 60.0

_SIZE = re.compile(r"(\d+)\s*([kmgtp]?)b?", re.IGNORECASE)


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
    return cluster.counted_capacity(conf)


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


@dataclasses.dataclass(frozen=True)
class Probed:
    """What the one-task probe saw on an executor."""

    #: Whether the task could open a TCP connection to this client (False when not asked).
    reached: bool
    #: The executors' interpreter (``sys.executable`` there) and its version; None when the probe
    #: learned nothing of it (it timed out, or failed for another reason than the Python).
    python: str | None = None
    version: str | None = None
    #: What a rank's task needs (``cluster.TASK_MODULES``) that this Python cannot import.
    missing: tuple[str, ...] = ()
    #: Why the probe job failed, where the executors' Python made it fail (no pyarrow, another minor
    #: version than this client's), in Spark's words.
    failure: str | None = None


#: What the probe found, per session and client address (None: reachability not asked): the
#: executors' Python and the network between them and this client do not change within a session,
#: and a probe costs one Spark job.
_PROBED: dict[tuple[str, str | None], Probed] = {}


def probe(view, host: str | None) -> Probed:
    """One one-task job that reports the executors' Python and, given ``host``, whether a task can
    open a TCP connection to it (this client): it connects to a listener here, whose kernel
    completes the handshake, so nothing needs to accept it. A job that does not finish in time
    counts as "cannot reach". Asked once per session and address. ``view``: the session's
    ``views.ConnectView``."""
    key = (str(getattr(view.spark, "session_id", id(view.spark))), host)
    if key not in _PROBED:
        _PROBED[key] = _probe(view, host)
    return _PROBED[key]


def executors_reach(view, host: str) -> bool:
    """Whether a task of this session can open a TCP connection to ``host`` (this client); see :func:`probe`."""
    return probe(view, host).reached


def check_executors_python(view, host: str | None) -> None:
    """Over Connect, the classic path's check of the executors' Python (``cluster.check_executors_python``),
    from the probe's report instead of by running that Python here: it must be this client's minor
    version and import sparktrain, cloudpickle and pyarrow. Raises ClusterConfigError naming both
    interpreters, their versions and the fix, before the run's stage launches. ``host``: as for
    :func:`probe` (the run asks with the address it probes anyway, so this costs no job of its own)."""
    found = probe(view, host)
    mine = versions.collect()["python"]
    theirs = found.version
    if found.failure is not None:
        problem = f"fails a task before sparktrain runs: {found.failure}"
    elif found.missing:
        problem = f"cannot import {', '.join(found.missing)}"
    elif theirs and mine and versions.mismatches({"python": mine}, {"python": theirs}):
        problem = "is another minor version than this client's, and cloudpickle's functions need the same"
    else:
        return
    which = f"the executors' Python, {found.python} (Python {theirs})," if found.python else "the executors' Python"
    where = found.python or "the executors' Python"
    raise ClusterConfigError(
        f"{which} {problem}; this client runs {sys.executable} (Python {mine}). Over Spark Connect the server "
        "starts the executors' Python: PYSPARK_PYTHON as its driver read it when it started (spark-submit sets it "
        "from spark.pyspark.python), else python3 from its PATH. Fix: start the Connect server with PYSPARK_PYTHON "
        f"set to a Python {'.'.join(mine.split('.')[:2])} that has sparktrain, cloudpickle and pyarrow (this "
        f"machine's: export PYSPARK_PYTHON={sys.executable}; for SparkSession.builder.remote(\"local[N]\"), export "
        "it before starting this Python, or set os.environ[\"PYSPARK_PYTHON\"] = sys.executable before building the "
        f"session); or install sparktrain, cloudpickle and pyarrow for {where}")


#: How Spark words a task that failed because of the executors' Python itself, before any code of ours ran.
_PYTHON_FAILURES = re.compile(r"(\[PYTHON_VERSION_MISMATCH\][^\n]*|No module named '?[\w.]+'?)")


def _probe(view, host: str | None) -> Probed:
    try:
        found = executor_probe.run(view, 1, host, barrier=False, timeout=PROBE_JOB_TIMEOUT,
                                   description="sparktrain: the executors' Python, and can they reach the client?")
    except OSError as e:
        log.debug("sparktrain: no probe listener on %s: %s", host, e)
        return Probed(False)
    if found.error is not None:
        m = _PYTHON_FAILURES.search(str(found.error))
        log.debug("sparktrain: the probe job failed: %s", found.error)
        return Probed(False, failure=m.group(1) if m else None)
    if not found.tasks:
        return Probed(False)
    task = found.tasks[0]
    return Probed(task["reach"] is None, task["executable"], task["versions"]["python"], tuple(task["missing"]))


def concurrent_slots(view, host: str, wanted: int, wait: float) -> int:
    """How many of ``wanted`` tasks of one (non-barrier) job run at once within ``wait`` seconds.

    Each task connects to a listener here and holds its connection until this client closes it,
    so the count is of tasks running at the same moment, which is what a barrier stage needs.
    Stops counting at ``wanted``; the job is cancelled by its tag afterwards. Needs executors that
    can reach this client (see :func:`executors_reach`).
    """
    import time

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held: list[socket.socket] = []
    job = None
    try:
        listener.bind((host, 0))
        listener.listen(max(8, wanted))
        port = listener.getsockname()[1]
        job = jobs.BarrierJob(view, f"sparktrain-slots-{port}", f"sparktrain: do {wanted} tasks run at once?",
                         lambda: view.spark.range(0, wanted, 1, wanted).mapInArrow(_hold(host, port, wait),
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
