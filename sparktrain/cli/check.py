"""``sparktrain check``: can this Spark cluster run ``sparktrain.run``?

A pre-flight like ``horovodrun --check-build``, for the cluster rather than the build. It reads
the session's conf, counts task slots and GPUs, then runs one small barrier stage (one task
per slot, the way ``run`` launches its ranks) in which every task reports its Python and package
versions, its GPUs, its storage backends and whether it can reach the driver. Problems that
would make ``run`` fail are printed as ``[FAIL]`` and make the command exit 1; ``[WARN]`` marks
what may bite later.
"""
from __future__ import annotations

import platform
import re
import sys
from typing import Any, Callable, Mapping, TextIO

from .. import __version__, settings
from . import build as check_build
from . import findings as capabilities
from .findings import Report
from ..host import nics
from ..seam import versions
from ..driver import face
from ..driver.face import probe
from ..errors import ClusterConfigError, InsufficientResourcesError, InvalidArgumentError

#: Versions shown for the driver and every task; ``versions.PACKAGES`` must match for ``run`` to start.
PACKAGES = (*versions.PACKAGES, "keras")
#: Optional storage backends and the extra that installs each.
BACKENDS = {"adlfs": "azure", "s3fs": "s3"}


def run_check(start_session: Callable[[], tuple[Any, bool]], num_proc: int | None = None, wait: float = 30.0,
              timeout: float = 120.0, out: TextIO | None = None, build: bool = False) -> int:
    """Check the cluster ``start_session()`` connects to; print the findings; return the exit code.

    Parameters
    ----------
    start_session : returns ``(SparkSession, owned)``; an owned session is stopped at the end.
    num_proc : the number of ranks to check for; None checks every task slot.
    wait : seconds to wait for executors to register.
    timeout : seconds the probing barrier stage may take.
    out : where the report goes (default ``sys.stdout``).
    build : also compile the TensorFlow kernels into every host's cache (``cli.build``).

    Returns 0 when ``run`` can launch, 1 when a problem would make it fail.

    Examples
    --------
    >>> from sparktrain.cli import main
    >>> main(["check", "--master", "local[2]"])  # doctest: +SKIP
    """
    report = Report(out or sys.stdout)
    report.line(f"sparktrain check (sparktrain {__version__}; driver Python {platform.python_version()} "
                f"at {sys.executable})")
    report.line()
    report.line("Spark")
    try:
        spark, owned = start_session()
    except Exception as e:  # noqa: BLE001 - whatever stopped Spark from starting is the finding
        report.fail(f"Spark did not start: {face.spark_error_reason(e)}")
        return report.finish()
    try:
        _check_session(report, spark, num_proc, wait, timeout, build)
    finally:
        if owned:
            spark.stop()
    return report.finish()


def _check_session(report: Report, spark, num_proc: int | None, wait: float, timeout: float, build: bool) -> None:
    view = face.view_of(spark)
    conf = view.conf
    master = conf.get("spark.master", "?")
    report.field("master", master + (f" (through {view.name})" if view.here == "client" else ""))
    report.field("Spark version", spark.version)
    if tuple(int(p) for p in re.findall(r"\d+", spark.version)[:2]) < (3, 5):
        report.fail(f"Spark {spark.version} is too old: sparktrain launches ranks with mapInArrow(barrier=True), "
                    "new in Spark 3.5. Upgrade the cluster to Spark 3.5 or later")

    try:  # the settings as a run here would resolve them (without its arguments and env=)
        values = face.settings_of(conf)
    except InvalidArgumentError as e:
        report.fail(str(e))
        values = face.settings_of({}, {})
    encrypted = settings.encrypts(values.encryption, conf)
    try:
        face.check_cluster_conf(conf, values.allow_unencrypted, encrypted, values.cpu_collectives)
        report.ok("barrier mode: dynamic allocation is off, so every rank can be gang-scheduled")
    except ClusterConfigError as e:
        report.fail(str(e))
    use_gpu = _check_gpu_conf(report, master, conf)

    if not view.lists_executors:
        cap = view.capacity()
        if cap is None:
            if num_proc is None:
                report.fail("a Spark Connect client cannot count the task slots of this cluster from its conf "
                            "(dynamic allocation, or spark.executor.instances/cores unset); pass --num-proc")
                return
            report.warn("the task slots cannot be counted from the conf over Spark Connect; the probing stage "
                        f"below shows whether {num_proc} rank(s) fit")
        else:
            report.field("executors", f"{cap.executors} (from the conf; a Connect client cannot list them)")
    else:
        # Executors register after the session starts; with the conf already broken, do not wait for them.
        expected = face.expected_executors(master, conf)
        cap = view.wait_for_executors(lambda c: c.executors >= (expected or 1), 0 if report.failures else wait)
        if face.is_local(master):
            report.field("executors", "1 (local mode: the driver runs the tasks)")
        else:
            report.field("executors", f"{cap.executors} registered" + (f" of {expected} expected" if expected else ""))
        if expected and 0 < cap.executors < expected:
            report.warn(f"only {cap.executors} of {expected} expected executors registered within {wait:g} s; "
                        "the others may still be starting (pass --wait to give them longer)")
    if cap is not None:
        _slots(report, cap, master, use_gpu)
    size = num_proc if num_proc is not None else cap.slots(use_gpu)
    if cap is None:
        pass  # not countable from a Connect client: the probing stage is the test
    elif size == 0:
        if not report.failures:  # with the conf already broken, no slots is a consequence, not a new problem
            report.fail(f"no task slots: {cap.executors} executor(s) registered within {wait:g} s. Start executors "
                        "(spark.executor.instances, spark.executor.cores), check the cluster manager's UI for "
                        "executors that fail to start, or pass --wait to wait longer")
    else:
        try:
            face.check_capacity(size, cap, use_gpu)
            report.ok(f"capacity: {size} rank(s) fit at once ({cap.slots(use_gpu)} {'GPU ' if use_gpu else ''}"
                      "task slot(s))")
        except InsufficientResourcesError as e:
            report.fail(str(e))

    driver = _local_facts()
    tasks: list[dict] = []
    if report.failures:
        report.line("  (the probing barrier stage is skipped until the problems above are fixed)")
    else:
        tasks = _probe(report, view, size, use_gpu, timeout, values.rendezvous)
        if build and not report.failures:
            check_build.build(report, view, driver, tasks, face.is_local(master), timeout)
    _versions(report, driver, tasks)
    _hosts(report, driver, tasks, values.nics)
    capabilities.engines(report, driver, tasks)
    capabilities.kernels(report, driver, tasks, values)
    capabilities.encryption(report, driver, tasks, values.encryption, encrypted)
    _backends(report, driver, tasks)


def _slots(report: Report, cap: face.Capacity, master: str, use_gpu: bool) -> None:
    slots = f"{cap.cpu_slots}: {cap.executors} executor(s) x {cap.cores_per_executor} core(s) / " \
            f"spark.task.cpus={cap.task_cpus}"
    if cap.spark_slots is not None and cap.spark_slots != cap.cpu_slots:
        slots += f" (Spark counts {cap.spark_slots})"
    report.field("task slots", slots)
    if use_gpu:
        offered = "spark.driver" if face.is_local(master) else "spark.executor"
        report.field("GPUs per executor", f"{cap.gpus_per_executor:g} ({offered}.resource.gpu.amount), "
                                          f"{cap.task_gpus:g} per task: {cap.gpu_slots} GPU slot(s)")


def _check_gpu_conf(report: Report, master: str, conf: Mapping[str, str]) -> bool:
    """Whether runs will use GPUs, with a FAIL when GPUs are asked for but cannot be found."""
    task = face.gpu_amount(conf)
    if task <= 0:
        report.ok("GPU scheduling: off (spark.task.resource.gpu.amount is not set), so ranks train on CPU; "
                  "conf/spark-defaults.conf turns it on")
        return False
    face.check_gpu_conf(conf, True)
    # Who finds the GPUs: the driver in local mode, the workers on local-cluster (they read the
    # driver's conf), the executors under YARN and Kubernetes. A standalone cluster's workers
    # read their own conf, which the driver cannot see.
    if face.is_local(master):
        component = "spark.driver"
    elif master.startswith("local-cluster"):
        component = "spark.worker"
    else:
        component = "spark.executor"
    script = f"{component}.resource.gpu.discoveryScript"
    keys = [script, f"{component}.resourcesFile"]
    if master.startswith("spark://"):
        keys += ["spark.worker.resource.gpu.discoveryScript", "spark.worker.resourcesFile"]
    found = [k for k in keys if conf.get(k)]
    if not found and master.startswith("spark://"):
        report.warn(f"spark.task.resource.gpu.amount={task:g}, and the driver's conf names no GPU discovery "
                    "script; on a standalone cluster each worker's own spark.worker.resource.gpu.discoveryScript "
                    "must find them (the barrier stage below shows whether tasks get GPUs)")
        return True
    if not found:
        report.fail(f"spark.task.resource.gpu.amount={task:g} asks for a GPU per task, but no GPU discovery script "
                    f"is set ({script} is empty), so Spark cannot find GPUs and never schedules the tasks. Fix: set "
                    f"{script} to a script that lists the GPUs, such as conf/get_gpus_resources.sh installed on "
                    "every node, or unset spark.task.resource.gpu.amount to train on CPU")
        return True
    if component != "spark.executor" and not conf.get(f"{component}.resource.gpu.amount"):
        report.fail(f"spark.task.resource.gpu.amount={task:g} asks for a GPU per task, but "
                    f"{component}.resource.gpu.amount is not set, so no GPU is offered to tasks. Fix: set it to the "
                    "number of GPUs per machine")
        return True
    report.ok(f"GPU scheduling: {task:g} GPU per task, found by {found[0]}={conf[found[0]]}")
    return True


def _local_facts() -> dict:
    """The driver's side of the versions table."""
    return probe.facts_function()(PACKAGES, tuple(BACKENDS))


def _probe(report: Report, view, size: int, use_gpu: bool, timeout: float, rendezvous: str) -> list[dict]:
    """Run one barrier stage of ``size`` tasks; each reports what it sees. Returns their reports."""
    # Ranks check in where run() listens: the driver, or this client over Spark Connect.
    host = view.driver_host()
    found = probe.run(view, size, host, PACKAGES, tuple(BACKENDS), timeout=timeout,
                      description=f"sparktrain check: a barrier stage of {size} task(s)")
    if found.timed_out:
        report.fail(f"the barrier stage of {size} task(s) did not finish within {timeout:g} s; every rank needs a "
                    "task slot at the same time. Look for pending tasks in the Spark UI, or pass --timeout")
        return []
    if found.error is not None:
        report.fail(f"the barrier stage of {size} task(s) failed: {face.spark_error_reason(found.error)}")
        return []
    tasks = found.tasks
    report.ok(f"barrier mode: a barrier stage of {size} task(s) ran in {found.seconds:.1f} s")
    if use_gpu:
        without = [t["task"] for t in tasks if not t["gpus"]]
        if without:
            report.fail(f"task(s) {without} got no GPU from Spark although spark.task.resource.gpu.amount is set; "
                        "check the discovery script's output on those executors")
        else:
            report.ok("GPUs: " + ", ".join(f"task {t['task']} got GPU {','.join(t['gpus'])}" for t in tasks))
    unreachable = [t for t in tasks if t["reach"]]
    if not unreachable:
        report.ok(f"every task reached the {view.here} at {host} (ranks check in there)")
    elif view.here == "client" and rendezvous != "driver":
        report.warn(f"{len(unreachable)} task(s) cannot reach this client at {host} ({unreachable[0]['reach']}); "
                    "over Spark Connect, runs then meet through Spark's barrier allGather, and each rank's output "
                    "tail comes back with the result or the error instead of live")
    elif rendezvous == "barrier":
        report.warn(f"{len(unreachable)} task(s) cannot reach the driver at {host} ({unreachable[0]['reach']}); "
                    "rendezvous=barrier is set, so runs still start, and ranks' output goes to executor logs")
    else:
        report.fail(f"{len(unreachable)} task(s) cannot reach the driver at {host} ({unreachable[0]['reach']}), "
                    "where ranks check in. Fix: open the driver's ports to the executors (spark.driver.host must be "
                    "an address they can reach), or set spark.sparktrain.rendezvous=barrier")
    return tasks


def _versions(report: Report, driver: dict, tasks: list[dict]) -> None:
    report.line()
    report.line("Versions (* differs from the driver)")
    want = driver["versions"]
    header = ["", "GPUs", "python", *PACKAGES]
    rows = [header, ["driver", "-", *[want[k] or "-" for k in ("python", *PACKAGES)]]]
    for t in tasks:
        have = t["versions"]
        cells = []
        for k in ("python", *PACKAGES):
            v = have.get(k) or "-"
            cells.append(v + "*" if versions.mismatches({k: want.get(k)}, {k: have.get(k)}) else v)
        rows.append([f"task {t['task']} at {t['address']}", ",".join(t["gpus"]) or "-", *cells])
    report.table(rows)
    if want.get("tensorflow") is None:
        report.warn("TensorFlow is not installed on the driver; sparktrain.tensorflow and sparktrain.keras need it "
                    "(pip install 'sparktrain[tensorflow]')")
    strict = {k: want[k] for k in ("python", *versions.PACKAGES)}  # what run's version handshake compares
    # One line per problem, naming the tasks it affects: a large cluster repeats the same one.
    missing = [t for t in tasks if t["versions"].get("sparktrain") is None]
    if missing:
        report.fail(f"sparktrain is not installed on the executors of {_where(missing)} ({missing[0]['executable']}); "
                    "every rank imports it. Install it there (a cluster library on Databricks, a workspace package "
                    "on Synapse, or pip install on every node)")
    lacking: dict[tuple, list[dict]] = {}
    for t in tasks:
        others = [m for m in t.get("missing", ()) if m != "sparktrain"]  # sparktrain's absence: the line above
        if others:
            lacking.setdefault((t["executable"], *others), []).append(t)
    for (exe, *modules), ts in lacking.items():
        report.fail(f"the executors' Python {exe} cannot import {', '.join(modules)} ({_where(ts)}), which every "
                    "rank's task imports; install them there (pip install sparktrain brings both)")
    differs: dict[str, list[dict]] = {}
    kerases: dict[str, list[dict]] = {}
    for t in tasks:
        if t in missing:
            continue
        for diff in versions.mismatches(strict, t["versions"]):
            differs.setdefault(diff, []).append(t)
        keras = t["versions"].get("keras")
        if want.get("keras") and keras != want["keras"]:
            kerases.setdefault(keras or "not installed", []).append(t)
    for diff, ts in differs.items():
        report.fail(f"{diff} ({_where(ts)}); runs would stop with VersionMismatchError. Install the same versions "
                    "on the executors as on the driver")
    old: dict[str, list[dict]] = {}
    for t in tasks:
        for problem in versions.below_floor(t["versions"]):
            old.setdefault(problem, []).append(t)
    for problem, ts in old.items():
        report.fail(f"on the executors of {_where(ts)}, {problem}")
    for keras, ts in kerases.items():
        report.warn(f"keras: driver {want['keras']}, this executor {keras} ({_where(ts)}); a model saved on one "
                    "side may not load on the other")
    if tasks and not any(t["versions"].get("tensorflow") for t in tasks) and want.get("tensorflow"):
        report.fail("TensorFlow is not installed on the executors, where the ranks train; install "
                    "'sparktrain[tensorflow]' there")


_where = capabilities.where


def _hosts(report: Report, driver: dict, tasks: list[dict], chosen: tuple[str, ...] | None) -> None:
    """What each executor host offers its ranks: the CPUs a task's process can use (its affinity mask
    capped by its cgroup quota) and its networks, with the address the nics setting picks there."""
    report.line()
    report.line("Hosts (CPUs a task can use: affinity and cgroup quota; networks" +
                (f"; nics={','.join(chosen)})" if chosen else ")"))
    seen: dict[str, list[dict]] = {}
    for t in tasks:
        seen.setdefault(t["address"].rsplit(":", 1)[0], []).append(t)
    rows = [("the driver", "the driver", driver)]
    rows += [(host, f"{host} ({len(ts)} task(s))", ts[0]) for host, ts in seen.items()]
    width = max(18, *(len(label) for _, label, _ in rows))
    for host, label, t in rows:
        networks = t.get("networks") or {}
        line = f"{t.get('cpus') or '?'} CPU(s); " + nics.describe({k: v for k, v in networks.items() if k != "lo"})
        if chosen:
            picked = nics.address(chosen, networks)
            line += f"; nics -> {picked or 'no address'}"
            if picked is None:
                report.fail(nics.no_match(chosen, host if t is driver else f"executor host {host}", networks))
        report.field(label, line, width)


def _backends(report: Report, driver: dict, tasks: list[dict]) -> None:
    report.line()
    report.line("Storage backends (checkpoint URLs)")
    for name, extra in BACKENDS.items():
        here = driver["backends"][name]
        there = [t["backends"].get(name) for t in tasks]
        ok_there = sum(1 for v in there if v and not v.startswith("!"))
        status = "not installed" if here is None else ("import fails" if here.startswith("!") else here)
        where = f"driver: {status}" + (f"; executors: imports on {ok_there} of {len(tasks)}" if tasks else "")
        report.field(name, where)
        broken = [v for v in [here, *there] if v and v.startswith("!")]
        if broken:
            report.warn(f"{name} is installed but does not import: {broken[0][1:]}")
        elif here is not None and tasks and ok_there < len(tasks):
            report.warn(f"{name} is on the driver but not on {len(tasks) - ok_there} executor(s); rank 0 writes "
                        f"checkpoints from its executor: pip install 'sparktrain[{extra}]' there")
