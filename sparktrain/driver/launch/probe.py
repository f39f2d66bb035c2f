"""The executor probe: one small stage whose tasks report what they see.

``sparktrain check`` runs it as a barrier stage of one task per rank; a run over Spark Connect
runs it as one plain task before it launches, to learn the executors' Python and whether they
can reach the client. Each task reports its interpreter, the package versions the driver asks
about, the storage backends that import, the CPU engine its ranks would use, its GPUs, and
whether it could open a TCP connection to ``host:port``.

The task function is built inside a function so that cloudpickle ships it by value: it needs
neither sparktrain nor pyarrow on the executor, which may be exactly what is missing there.
The stage is the view's (``views.ClusterView.stage``): on a classic session an RDD one, which needs
nothing but Python; over Connect, which has no RDDs, ``mapInArrow``.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import time
import uuid
from typing import Callable

from . import cluster, jobs

#: Seconds a probing task waits for a TCP connection to the driver or client.
CONNECT_TIMEOUT = 3.0


def facts_function() -> Callable[[tuple, tuple], dict]:
    """What a process reports about itself: Python, package versions, storage backends, CPU engine,
    the CPUs it can use and its networks, and which of the modules a rank's task imports
    (``cluster.TASK_MODULES``) it cannot import.
    The driver calls the same function for its side of ``check``'s tables."""
    task_modules = cluster.TASK_MODULES

    def facts(packages: tuple, backends: tuple) -> dict:
        import platform
        import sys
        from importlib import metadata, util

        missing = []
        for m in task_modules:
            try:
                if util.find_spec(m) is None:
                    missing.append(m)
            except (ImportError, ValueError):
                missing.append(m)
        found = {"executable": sys.executable, "versions": {"python": platform.python_version()},
                 "backends": {}, "missing": missing}
        try:  # what ranks here could use: CPUs (affinity and cgroup quota) and networks (for nics)
            from sparktrain.host import cpus, nics

            found["cpus"], found["networks"] = cpus.usable_cpus(), nics.interfaces()
        except Exception as e:  # noqa: BLE001 - no sparktrain here is reported by the versions table
            found["cpus"], found["networks"] = None, {"?": [f"{type(e).__name__}"]}
        try:  # which engine a rank's CPU collectives would run on here
            from sparktrain import engine

            found["cpu_engine"] = "native" if engine.available() else f"tensorflow ({engine.unavailable_reason()})"
        except Exception as e:  # noqa: BLE001 - no sparktrain here is reported by the versions table
            found["cpu_engine"] = f"unknown ({type(e).__name__})"
        try:  # whether the channel and the engine's ring could be encrypted here: None when they can
            from sparktrain.seam import crypto
            from sparktrain import engine

            found["crypto"] = crypto.unavailable() or (engine.crypto_unavailable() if engine.available() else None)
        except Exception as e:  # noqa: BLE001 - no sparktrain here is reported by the versions table
            found["crypto"] = f"unknown ({type(e).__name__})"
        try:  # what a rank's init() will do about the TensorFlow kernels here (TensorFlow is not imported)
            from sparktrain.engine import kernel_cache

            found["tf_kernels"] = kernel_cache.plan()
        except Exception as e:  # noqa: BLE001 - no sparktrain here is reported by the versions table
            found["tf_kernels"] = {"path": "unknown", "why": f"{type(e).__name__}: {e}", "cache": None}
        for name in packages:
            try:
                found["versions"][name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found["versions"][name] = None
        for name in backends:  # the version of each that imports; None if absent; "!error" if its import fails
            try:
                module = __import__(name)
                found["backends"][name] = str(getattr(module, "__version__", "installed"))
            except ModuleNotFoundError as e:
                found["backends"][name] = None if e.name == name else f"!{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a broken install is a finding
                found["backends"][name] = f"!{type(e).__name__}: {e}"
        return found

    return facts


def stage_task(report: Callable):
    """A function for each task of a stage over its partition: it yields one JSON report,
    ``{"task": its number, "address": where it ran, **report(task context)}``."""

    def task(_rows):
        import json
        import socket

        from pyspark import BarrierTaskContext, TaskContext

        for _ in _rows:
            pass
        ctx = TaskContext.get()
        me = ctx.partitionId()
        where = ctx.getTaskInfos()[me].address if isinstance(ctx, BarrierTaskContext) else socket.gethostname()
        yield json.dumps({"task": me, "address": where, **report(ctx)})

    return task


def task_function(packages: tuple, backends: tuple, address: tuple[str, int] | None):
    """The function each probing task runs over its partition; yields one JSON report."""
    facts = facts_function()
    timeout = CONNECT_TIMEOUT

    def probe(ctx) -> dict:
        import socket

        gpu = ctx.resources().get("gpu")
        info = {"gpus": list(gpu.addresses) if gpu else [], **facts(packages, backends)}
        # Ranks check in with the driver (or the Connect client) over TCP: can this executor connect?
        # The listener's kernel completes the handshake, so nothing needs to accept the connection.
        info["reach"] = "not asked"
        if address is not None:
            try:
                socket.create_connection(address, timeout=timeout).close()
                info["reach"] = None
            except OSError as e:
                info["reach"] = f"{type(e).__name__}: {e}"
        return info

    return stage_task(probe)


@dataclasses.dataclass
class Probe:
    """What one probing stage found."""

    #: One report per task, by task number (see :func:`facts_function` and :func:`task_function`).
    tasks: list[dict]
    #: The stage's failure as Spark raised it, or None.
    error: BaseException | None = None
    #: True when the stage did not finish within its timeout (it was cancelled).
    timed_out: bool = False
    #: Seconds the stage took.
    seconds: float = 0.0


def run(view, size: int, host: str | None, packages: tuple = (), backends: tuple = (), barrier: bool = True,
        timeout: float = 60.0, description: str = "sparktrain: probe the executors", task=None) -> Probe:
    """Run ``size`` probing tasks (a barrier stage unless ``barrier=False``); with ``host``, each
    task also reports whether it can open a TCP connection to a listener there. ``task``: another
    function for the tasks to run, yielding one JSON report each with its ``task`` number."""
    listener = None
    address = None
    if host is not None:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(max(16, size))  # a backlog for every task: nothing needs to accept
            address = (host, listener.getsockname()[1])
        except OSError:
            listener.close()
            raise
    task = task or task_function(packages, backends, address)
    job = jobs.BarrierJob(view, f"sparktrain-probe-{uuid.uuid4().hex[:12]}", description,
                          lambda: view.stage(size, task, barrier))
    started = time.monotonic()
    job.start()
    try:
        if not job.wait(timeout):
            job.cancel()
            job.wait(30)
            return Probe([], timed_out=True, seconds=time.monotonic() - started)
    finally:
        if listener is not None:
            listener.close()
    seconds = time.monotonic() - started
    if job.error is not None:
        return Probe([], error=job.error, seconds=seconds)
    return Probe(sorted((json.loads(r) for r in job.rows), key=lambda t: t["task"]), seconds=seconds)
