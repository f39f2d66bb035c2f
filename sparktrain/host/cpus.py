"""A host's CPUs and how its ranks share them: the CPUs this process can really use (its affinity
mask, capped by its cgroup's CPU quota), each rank's compute threads and thread-pool variables,
and the cores a pinned rank keeps to.

``os.cpu_count()`` counts the machine. A container on Databricks, Kubernetes or YARN, or an
executor confined to a cpuset, can use fewer: the cores in its affinity mask, and no more CPU
time than its cgroup's quota (v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2 ``cpu.max``).
The barrier task measures this once for its rank (``SPARKTRAIN_CPU_BUDGET``): the compute
threads of a rank Spark granted no CPUs, and the native engine's decision to spin-wait, follow it.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

#: The thread-pool variables :func:`thread_defaults` sets, unless the user or the executor already does.
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"``); None for no limit.

    >>> parse_cpu_max("150000 100000"), parse_cpu_max("max 100000")
    (1.5, None)
    """
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = float(parts[1]) if len(parts) > 1 else 100000.0
    return float(parts[0]) / period if period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``; None for no limit.

    >>> parse_cfs("-1", "100000"), parse_cfs("200000", "100000")
    (None, 2.0)
    """
    q, p = int(quota.strip()), int(period.strip())
    return q / p if q > 0 and p > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a/b", "/a", "/"]``: a quota anywhere above a cgroup limits it too."""
    out = [path]
    while path not in ("/", ""):
        path = os.path.dirname(path)
        out.append(path or "/")
    return out


def quota_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, v1 or v2; None for none."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits: list[float] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            for p in _ancestors(path):
                found = _read(os.path.join(root, p.lstrip("/"), "cpu.max"))
                limit = parse_cpu_max(found) if found else None
                if limit is not None:
                    limits.append(limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                base = os.path.join(root, mount)
                if not os.path.isdir(base):
                    continue
                for p in _ancestors(path):
                    d = os.path.join(base, p.lstrip("/"))
                    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
                    limit = parse_cfs(quota, period) if quota and period else None
                    if limit is not None:
                        limits.append(limit)
                break
    return min(limits) if limits else None


def usable_cpus() -> int:
    """The CPUs this process can use: its affinity mask, capped by its cgroup quota (rounded up:
    a quota of 1.5 CPUs keeps two threads busy part of the time). At least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = quota_cpus()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def host_budget(task_cpus: int | None, local_size: int, usable: int | None = None) -> int:
    """The CPUs a host's ``local_size`` ranks can use together: what this task's process can use
    (all of them share the executor's mask and cgroup), capped by Spark's task CPUs per rank.

    >>> host_budget(None, 3, usable=2), host_budget(1, 2, usable=8), host_budget(4, 2, usable=2)
    (2, 2, 2)
    """
    usable = usable_cpus() if usable is None else usable
    return max(1, min(usable, task_cpus * local_size) if task_cpus else usable)


def rank_threads(task_cpus: int | None, cpu_count: int | None, local_size: int) -> int:
    """Compute threads for one rank: its task's CPUs (``spark.task.cpus`` or the run's
    ``resources={"cpus": n}``) where Spark granted them, as TorchDistributor and Horovod do; else
    (local mode, no Spark grant) its share of the CPUs this host's ranks can really use
    (``cpu_count``, :func:`usable_cpus`); at least 1.

    A grant is the operator's statement about the executor and is kept even where it exceeds
    the cores this process sees; the engine's spin policy still follows the measured budget.

    >>> rank_threads(4, 16, 2), rank_threads(None, 2, 3), rank_threads(None, 8, 2), rank_threads(4, 2, 2)
    (4, 1, 4, 4)
    """
    if task_cpus:
        return max(1, int(task_cpus))
    return max(1, (cpu_count or 1) // max(1, local_size))


def rank_cores(allowed: Sequence[int], local_rank: int, local_size: int) -> list[int] | None:
    """The cores a rank keeps to when it is pinned: ``allowed`` split into equal, disjoint runs,
    one per rank on the host; None when ranks outnumber the cores (the kernel shares them better
    than a fixed split would).

    A pinned rank stays on its own cores, away from the other ranks' helper threads, instead of
    migrating between the host's cores.

    >>> rank_cores([0, 1, 2, 3], 1, 2), rank_cores([0, 1], 0, 3)
    ([2, 3], None)
    """
    if local_size < 1 or local_size > len(allowed):
        return None
    per = len(allowed) // local_size
    return list(allowed[local_rank * per:(local_rank + 1) * per])


def thread_defaults(threads: int, env: Mapping[str, str]) -> dict[str, str]:
    """OpenMP's and TensorFlow's thread counts for a rank, for each one ``env`` does not set.

    Each rank gets its share of the cores, not a thread per core of the machine: ranks whose
    pools together hold more threads than the host has cores contend for them.

    TensorFlow's inter-op pool keeps at least 2 threads: with 1, a collective that waits for its
    peers (a ``numpy_function`` into the native engine) holds the only one, and the step's other
    ops queue behind it.

    >>> thread_defaults(1, {"OMP_NUM_THREADS": "4"})
    {'TF_NUM_INTRAOP_THREADS': '1', 'TF_NUM_INTEROP_THREADS': '2'}
    """
    values = {"OMP_NUM_THREADS": threads, "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": max(2, threads)}
    return {k: str(values[k]) for k in THREAD_VARS if k not in env}
