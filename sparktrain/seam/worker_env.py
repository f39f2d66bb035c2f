"""The env contract: what every rank's process finds in its environment.

Pure functions only, so the contract is unit-tested without Spark. The same names are
documented in docs/env-contract.md.
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

RANK = "SPARKTRAIN_RANK"
SIZE = "SPARKTRAIN_SIZE"
LOCAL_RANK = "SPARKTRAIN_LOCAL_RANK"
LOCAL_SIZE = "SPARKTRAIN_LOCAL_SIZE"
CROSS_RANK = "SPARKTRAIN_CROSS_RANK"
CROSS_SIZE = "SPARKTRAIN_CROSS_SIZE"
RUN_ID = "SPARKTRAIN_RUN_ID"
#: Where ``hvd.elastic`` commits: a named run's name (``run_id=``), else ``run_elastic``'s run id
#: (without it, the run id too).
ELASTIC_ID = "SPARKTRAIN_ELASTIC_ID"
#: ``run_elastic``'s attempt number (1, 2, ...): names the attempt's resize marker in the run's home
#: (``sparktrain.storage.home``).
ELASTIC_ATTEMPT = "SPARKTRAIN_ELASTIC_ATTEMPT"


def elastic_id(environ) -> str:
    """In a rank: the id of the run's home, ``<elastic_url>/<id>/`` (``run_elastic``'s, else the run's)."""
    return environ.get(ELASTIC_ID) or environ.get(RUN_ID) or "standalone"


#: Which attempt of the run this is, 1-based (see ``run(..., max_attempts=N)``).
ATTEMPT = "SPARKTRAIN_ATTEMPT"
#: How many attempts the run has in all (``run(..., max_attempts=N)``); elastic state reads it.
MAX_ATTEMPTS = "SPARKTRAIN_ATTEMPTS_ALLOWED"
#: The directory holding this rank's spool of the DataFrames fed with ``run(..., data=...)``.
DATA_DIR = "SPARKTRAIN_DATA_DIR"

#: A file holding the key every collective connection of the run proves it holds (sparktrain.engine).
COLLECTIVE_KEY_FILE = "SPARKTRAIN_COLLECTIVE_KEY_FILE"
#: A file where the native engine records which collective the rank is in, and since when; the
#: rank's task reads it to report stalls (sparktrain.engine.progress).
PROGRESS_FILE = "SPARKTRAIN_PROGRESS_FILE"

#: How many compute threads the rank should use: its task's CPUs (see :func:`thread_defaults`).
THREADS = "SPARKTRAIN_THREADS"
#: The cores the rank keeps to, comma-separated, when it is pinned (see :func:`rank_cores`).
CORES = "SPARKTRAIN_CORES"
#: The CPUs this host's ranks can use together (``sparktrain.host.cpus.host_budget``): the native engine
#: spin-waits only where the host's ranks do not outnumber them.
CPU_BUDGET = "SPARKTRAIN_CPU_BUDGET"
#: The rank process's ``gc.set_threshold`` (the ``gc_threshold`` setting), and its default: read
#: in the rank before it loads train_fn.
GC_THRESHOLD = "SPARKTRAIN_GC_THRESHOLD"
GC_THRESHOLD_DEFAULT = "700,10,100"
#: The variables :func:`thread_defaults` sets, unless the user or the executor already does.
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")

#: What ``keras.distribution.initialize()`` reads (and ``sparktrain.jax.initialize()``), set on JAX runs.
JAX_COORDINATOR = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
JAX_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
JAX_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"
JAX_VARS = (JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID)

#: The variables that together define a rank; the worker API needs all of them or none.
TOPOLOGY_VARS = (RANK, SIZE, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE)

#: Every variable the contract sets; user ``env`` may not override these.
RESERVED_VARS = frozenset(
    TOPOLOGY_VARS
    + (RUN_ID, ATTEMPT, MAX_ATTEMPTS, DATA_DIR, COLLECTIVE_KEY_FILE, PROGRESS_FILE, THREADS, CPU_BUDGET, "TF_CONFIG", "RANK",
       "WORLD_SIZE", "LOCAL_RANK",
       "LOCAL_WORLD_SIZE",
       "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES") + JAX_VARS
)

#: What CUDA_VISIBLE_DEVICES is set to when a rank must see no GPU.
NO_GPU = "-1"

#: The env contract: what every rank's process finds in its environment, as
#: ``(variables, meaning)``. The docs' env-contract table is generated from it.
CONTRACT: tuple[tuple[tuple[str, ...], str], ...] = (
    ((RANK, SIZE), "this rank, and the number of ranks; ranks are numbered host by host"),
    ((LOCAL_RANK, LOCAL_SIZE), "index among, and number of, the run's ranks on this host"),
    ((CROSS_RANK, CROSS_SIZE), "index of this host among, and number of, the hosts that run a rank with this "
                               "local rank"),
    ((RUN_ID,), "the run's id, the same for every attempt"),
    ((ELASTIC_ID,), "under ``run_elastic``, and under ``run`` with ``run_id=``: the id ``hvd.elastic`` commits "
                    "under, the run's name (``run_id=``) where it has one, else its id (the same for every attempt "
                    "and size, and for every job of a named run)"),
    ((ELASTIC_ATTEMPT,), "only under ``run_elastic``: the attempt's number; rank 0 watches the run's home for "
                         "the driver's resize marker of this attempt, and the ranks end the attempt at a commit when "
                         "it is there"),
    ((ATTEMPT,), "which attempt this is, 1-based (``run(..., max_attempts=N)``)"),
    ((MAX_ATTEMPTS,), "how many attempts the run may have in all (under ``run_elastic``, ``reset_limit`` + 1; 0 "
                      "without a ``reset_limit``); elastic state reads it"),
    (("TF_CONFIG",), 'TensorFlow\'s cluster: ``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": '
                     '"worker", "index": rank}}``; each port was reserved by the task that owns it'),
    (("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
     "the same, under the names PyTorch reads; ``MASTER_PORT`` is a second port reserved by rank 0"),
    (("CUDA_VISIBLE_DEVICES",), "the GPU(s) Spark assigned to this task, translated through any mask the "
                                "executor already has; ``-1`` when the run uses no GPU"),
    (("KERAS_BACKEND",), "the run's Keras backend, where it names one (``run(backend=...)``, the driver's "
                         "``KERAS_BACKEND`` or ``spark.sparktrain.backend``); unset otherwise"),
    (JAX_VARS, "only on JAX runs: rank 0's host and ``MASTER_PORT`` (JAX's coordinator), the number of ranks, and "
               "this rank, as ``keras.distribution.initialize()`` and ``sparktrain.jax.initialize()`` read them"),
    (("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"), "only on JAX runs, in ranks without a GPU: ``cpu``, and the CPU "
                                               "devices each rank shows (``spark.sparktrain.jaxCpuDevices``, "
                                               "default 1)"),
    ((THREADS,), "the rank's compute threads: the CPUs Spark granted its task (``resources={'cpus': n}`` or "
                 "``spark.task.cpus`` on a cluster), else the CPUs this host's ranks can use, shared among them"),
    (THREAD_VARS, "``SPARKTRAIN_THREADS`` (the inter-op pool at least 2), unless ``env`` or the executor's own "
                  "environment sets them"),
    ((CPU_BUDGET,), "the CPUs this host's ranks can use together (affinity mask, cgroup quota, task CPUs); "
                    "the native engine spin-waits only where the ranks do not outnumber them"),
    ((CORES,), "the cores the rank keeps to (comma-separated) when it is pinned (``SPARKTRAIN_PIN_CORES``); "
               "unset when it is not"),
    ((COLLECTIVE_KEY_FILE,), "a file only the rank can read, holding the key its collective connections prove "
                             "they hold"),
    ((PROGRESS_FILE,), "a file in the rank's work directory where the native engine records which collective "
                       "the rank is in and since when; the rank's task reads it to report stalls"),
    ((DATA_DIR,), "only with ``run(..., data=...)``: this rank's data directory (its spool, and the cache of the row "
     "groups it reads from files), which ``sparktrain.data`` reads"),
    (("PYTHONUNBUFFERED",), "``1``, so that output reaches the driver line by line; ``env`` may override it"),
    (("TF_CPP_MIN_LOG_LEVEL",), "``2`` (TensorFlow's C++ INFO and WARNING lines hidden), ``0`` with "
                                "``run(verbose=2)``; ``env`` or the executor's environment wins"),
    (("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "SPARKTRAIN_MLFLOW", "SPARKTRAIN_MLFLOW_RUN_ID"),
     "only when the driver uses MLflow: on rank 0 the driver's run and credentials, on the other ranks a "
     "throwaway local store"),
)


def topology(hosts: Sequence[str], rank: int) -> dict[str, int]:
    """Horovod's topology numbers for ``rank`` given every rank's host, in rank order.

    ``local_rank`` counts the ranks before this one on the same host. ``cross_rank`` is the
    index of this host among the hosts that run a process with the same ``local_rank``, and
    ``cross_size`` is how many such hosts there are.

    >>> topology(["a", "a", "b"], 2)
    {'rank': 2, 'size': 3, 'local_rank': 0, 'local_size': 1, 'cross_rank': 1, 'cross_size': 2}
    """
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside 0..{len(hosts) - 1}")
    host = hosts[rank]
    local_rank = sum(1 for h in hosts[:rank] if h == host)
    local_size = sum(1 for h in hosts if h == host)
    # The hosts that have a process with this local_rank, in order of first appearance.
    seen: dict[str, int] = {}
    peers: list[str] = []
    for h in hosts:
        seen[h] = seen.get(h, -1) + 1
        if seen[h] == local_rank:
            peers.append(h)
    return {
        "rank": rank,
        "size": len(hosts),
        "local_rank": local_rank,
        "local_size": local_size,
        "cross_rank": peers.index(host),
        "cross_size": len(peers),
    }


def ranks_by_host(task_hosts: Sequence[str]) -> list[int]:
    """Each barrier task's rank, given every task's host in partition order (Horovod's numbering).

    Hosts come in the order of their first task; within a host, ranks are contiguous and follow
    the tasks' order. So the first ``local_size`` ranks share a machine, and on hosts that run
    the same number of ranks ``local_rank == rank % local_size``. Every task computes the same
    list from ``BarrierTaskContext.getTaskInfos()``, with no message between them.

    >>> ranks_by_host(["a", "b", "a", "b"])
    [0, 2, 1, 3]
    """
    order: dict[str, list[int]] = {}
    for partition, host in enumerate(task_hosts):
        order.setdefault(host, []).append(partition)
    ranks = [0] * len(task_hosts)
    for rank, partition in enumerate(p for partitions in order.values() for p in partitions):
        ranks[partition] = rank
    return ranks


def rank_threads(task_cpus: int | None, cpu_count: int | None, local_size: int) -> int:
    """Compute threads for one rank: its task's CPUs (``spark.task.cpus`` or the run's
    ``resources={"cpus": n}``) where Spark granted them, as TorchDistributor and Horovod do; else
    (local mode, no Spark grant) its share of the CPUs this host's ranks can really use
    (``cpu_count``, from ``sparktrain.host.cpus``); at least 1.

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

    Unpinned ranks on a busy host keep migrating between cores and meeting each other's helper
    threads.

    >>> rank_cores([0, 1, 2, 3], 1, 2), rank_cores([0, 1], 0, 3)
    ([2, 3], None)
    """
    if local_size < 1 or local_size > len(allowed):
        return None
    per = len(allowed) // local_size
    return list(allowed[local_rank * per:(local_rank + 1) * per])


def thread_defaults(threads: int, env: Mapping[str, str]) -> dict[str, str]:
    """OpenMP's and TensorFlow's thread counts for a rank, for each one ``env`` does not set.

    Ranks that each start one thread per core fight over the cores: three ranks with two
    intra-op threads each on two cores run slower than with one.

    TensorFlow's inter-op pool keeps at least 2 threads: with 1, a collective that waits for its
    peers (a ``numpy_function`` into the native engine) holds the only one, and the step's other
    ops queue behind it.

    >>> thread_defaults(1, {"OMP_NUM_THREADS": "4"})
    {'TF_NUM_INTRAOP_THREADS': '1', 'TF_NUM_INTEROP_THREADS': '2'}
    """
    values = {"OMP_NUM_THREADS": threads, "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": max(2, threads)}
    return {k: str(values[k]) for k in THREAD_VARS if k not in env}


def translate_gpu_ids(addresses: Sequence[str], visible: str | None) -> str:
    """Map the GPU addresses Spark assigned to a task onto ``CUDA_VISIBLE_DEVICES``.

    Spark's addresses are indices into the devices the executor can see. When the executor
    itself already runs under a ``CUDA_VISIBLE_DEVICES`` mask, address ``i`` means the
    ``i``-th entry of that mask. An empty ``addresses`` hides every GPU.

    >>> translate_gpu_ids(["1"], "4,5,6")
    '5'
    >>> translate_gpu_ids(["0"], None)
    '0'
    """
    if not addresses:
        return NO_GPU
    if visible is None or visible.strip() == "":
        return ",".join(str(a).strip() for a in addresses)
    mask = [v.strip() for v in visible.split(",") if v.strip()]
    out = []
    for a in addresses:
        try:
            out.append(mask[int(a)])
        except (ValueError, IndexError):
            raise ValueError(
                f"Spark assigned GPU address {a!r}, but the executor's CUDA_VISIBLE_DEVICES={visible!r} "
                f"has only {len(mask)} entries; make the discovery script report indices into that mask"
            ) from None
    return ",".join(out)


def build_worker_env(
    *,
    rank: int,
    hosts: Sequence[str],
    ports: Sequence[int],
    master_port: int,
    gpu_ids: str,
    run_id: str,
    user_env: Mapping[str, str] | None = None,
    attempt: int = 1,
    max_attempts: int = 1,
    threads: int | None = None,
) -> dict[str, str]:
    """The environment one rank's process gets, on top of the executor's own.

    Parameters
    ----------
    rank : this process's rank.
    hosts : every rank's host, in rank order.
    ports : every rank's port for the collective runtime (TensorFlow's server), in rank order.
    master_port : the port rank 0 reserved for ``MASTER_PORT`` (PyTorch's rendezvous store).
    gpu_ids : the value for ``CUDA_VISIBLE_DEVICES`` (see :func:`translate_gpu_ids`).
    run_id : the run's id.
    user_env : the ``env`` passed to ``run``; reserved names are refused earlier, on the driver.
    attempt : which attempt of the run this is, 1-based.
    max_attempts : how many attempts the run has in all, as ``SPARKTRAIN_ATTEMPTS_ALLOWED``.
    threads : the rank's compute threads (:func:`rank_threads`), as ``SPARKTRAIN_THREADS``.

    Examples
    --------
    >>> env = build_worker_env(rank=1, hosts=["h", "h"], ports=[5000, 5001], master_port=5002,
    ...                        gpu_ids="-1", run_id="r")
    >>> env["SPARKTRAIN_LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]
    ('1', 'h', '5002')
    """
    if len(hosts) != len(ports):
        raise ValueError(f"got {len(hosts)} hosts but {len(ports)} ports")
    t = topology(hosts, rank)
    # Output must reach the driver line by line, not when an 8 KiB buffer fills.
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(user_env or {})
    env.update({
        RANK: str(t["rank"]),
        SIZE: str(t["size"]),
        LOCAL_RANK: str(t["local_rank"]),
        LOCAL_SIZE: str(t["local_size"]),
        CROSS_RANK: str(t["cross_rank"]),
        CROSS_SIZE: str(t["cross_size"]),
        RUN_ID: run_id,
        ATTEMPT: str(attempt),
        MAX_ATTEMPTS: str(max_attempts),
        "TF_CONFIG": json.dumps({
            "cluster": {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]},
            "task": {"type": "worker", "index": rank},
        }),
        "RANK": str(t["rank"]),
        "WORLD_SIZE": str(t["size"]),
        "LOCAL_RANK": str(t["local_rank"]),
        "LOCAL_WORLD_SIZE": str(t["local_size"]),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
        "CUDA_VISIBLE_DEVICES": gpu_ids,
    })
    if threads is not None:
        env[THREADS] = str(threads)
    return env


def xla_thread_defaults(threads: int, gpu_ids: str, env: Mapping[str, str]) -> dict[str, str]:
    """XLA's CPU threads for a JAX rank without a GPU: its CPU client's thread pools sized to the
    rank's ``threads`` (``PJRT_NPROC``), where the rank shows one CPU device and ``env`` sets
    neither ``PJRT_NPROC`` nor ``NPROC``; and, unless ``env`` sets ``XLA_FLAGS``, Eigen's thread
    pool off (each op on the calling thread) for a rank that has one core's share.

    XLA starts its pools with a thread per core of the machine, in every rank, and they spin
    looking for work, taking the CPU that the ranks beside them need for their own steps; so
    each rank gets its share, as with TensorFlow's pools (:func:`thread_defaults`), and Eigen's
    pool is off where a rank has one core's share (benchmarks/jax_throughput.py measures it). A
    rank with more CPU devices keeps XLA's pools (each device's computation may need a thread
    while another waits in a collective).

    >>> xla_thread_defaults(1, "-1", {"JAX_NUM_CPU_DEVICES": "1"})
    {'PJRT_NPROC': '1', 'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false'}
    >>> xla_thread_defaults(2, "-1", {"JAX_NUM_CPU_DEVICES": "1"})
    {'PJRT_NPROC': '2'}
    >>> xla_thread_defaults(1, "-1", {"JAX_NUM_CPU_DEVICES": "4", "XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    {}
    """
    if gpu_ids != NO_GPU:
        return {}
    out = {}
    if env.get("JAX_NUM_CPU_DEVICES", "1") == "1" and not {"PJRT_NPROC", "NPROC"} & set(env):
        out["PJRT_NPROC"] = str(max(1, threads))
    if "XLA_FLAGS" not in env and threads <= 1:
        out["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    return out


def jax_env(hosts: Sequence[str], rank: int, coordinator_port: int, gpu_ids: str,
            cpu_devices: int = 1) -> dict[str, str]:
    """What a rank of a JAX run finds besides the rest of the contract: JAX's coordinator (rank 0's
    host and the port it reserved, ``MASTER_PORT``), the number of processes and this one's id, as
    ``keras.distribution.initialize()`` reads them; in a rank without a GPU, JAX's CPU platform
    with ``cpu_devices`` devices (no CUDA plugin is loaded there, so none fails to start).

    >>> jax_env(["h", "h"], 1, 5002, "-1", 2)["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
    'h:5002'
    >>> "JAX_PLATFORMS" in jax_env(["h"], 0, 5002, "0")  # a GPU rank: JAX chooses its platform
    False
    """
    host = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]  # an IPv6 address
    env = {"KERAS_BACKEND": "jax", JAX_COORDINATOR: f"{host}:{coordinator_port}",
           JAX_NUM_PROCESSES: str(len(hosts)), JAX_PROCESS_ID: str(rank)}
    if gpu_ids == NO_GPU:
        env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(cpu_devices)})
    return env
