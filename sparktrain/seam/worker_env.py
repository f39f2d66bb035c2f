"""The env contract: the names of what every rank's process finds in its environment, the names
a user's ``env`` may not set, and what each means (:data:`CONTRACT`, which docs/env-contract.md
is generated from).

The values are built elsewhere, each by the room of its subject: the rank numbering
(``seam.topology``), the CPUs (``host.cpus``), the GPUs (``host.gpus``), JAX's coordinator and
XLA's threads (``_jax.env``); ``executor.rankenv`` puts them together.
"""
from __future__ import annotations

from ..host.cpus import THREAD_VARS

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

#: How many compute threads the rank should use: its task's CPUs (``host.cpus.rank_threads``).
THREADS = "SPARKTRAIN_THREADS"
#: The cores the rank keeps to, comma-separated, when it is pinned (``host.cpus.rank_cores``).
CORES = "SPARKTRAIN_CORES"
#: The CPUs this host's ranks can use together (``sparktrain.host.cpus.host_budget``): the native engine
#: spin-waits only where the host's ranks do not outnumber them.
CPU_BUDGET = "SPARKTRAIN_CPU_BUDGET"
#: The rank process's ``gc.set_threshold`` (the ``gc_threshold`` setting), and its default: read
#: in the rank before it loads train_fn.
GC_THRESHOLD = "SPARKTRAIN_GC_THRESHOLD"
GC_THRESHOLD_DEFAULT = "700,10,100"

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
