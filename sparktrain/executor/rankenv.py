"""The rank process's environment, built once, after the rendezvous.

The held rank process starts before the rendezvous with :func:`start_env`: the executor's own
environment, the user's ``env`` and the import path, all that a Python interpreter reads as it
starts. :func:`rank_env` adds what the rendezvous decides (topology, ports, threads, cores, GPUs,
the collective key, the spool, MLflow's hand-off); the process takes it whole at its go.
:func:`build_worker_env` is the env contract's core (``seam.worker_env``) for one rank, as a pure
function of its arguments.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Mapping, Sequence

from .._jax import env as jax_env
from ..engine import kernel_cache
from ..host import cpus, gpus
from ..settings import rank as rank_settings
from ..seam import topology, tracking, worker_env as we
from ..errors import SparkTrainError
from ..seam.spec import TaskSpec


def start_env(spec: TaskSpec) -> dict[str, str]:
    """What the rank process starts with: everything an interpreter reads as it starts, as the
    full environment will have it (:func:`rank_env` only adds to it)."""
    env = dict(os.environ)
    env.update(spec.user_env)
    env["PYTHONPATH"] = _child_pythonpath()
    # The user's env or the executor's own wins; otherwise the run's default (quiet unless verbose=2).
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", str(spec.tf_log_level))
    _keras_home(env)
    return env


def _keras_home(env: dict[str, str]) -> None:
    """Keras keeps its config and downloads in ``~/.keras``, or in ``/tmp/.keras`` where HOME is not
    writable: a name every user of the host shares, so the first one's stands in the others' way.
    There, unless ``KERAS_HOME`` is set, the rank's Keras gets this user's kernel cache instead."""
    home = env.get("HOME") or os.path.expanduser("~")
    if env.get("KERAS_HOME") or (home and os.access(home, os.W_OK)):
        return
    try:
        env["KERAS_HOME"] = os.path.join(kernel_cache.cache_dir(env), "keras")
    except OSError:
        pass  # no writable place: Keras then does without one


def rank_env(spec: TaskSpec, rank: int, hosts: Sequence[str], ports: Sequence[int], master_port: int,
             topo: Mapping[str, int], gpu_addresses: Sequence[str] | None, workdir: str, key: bytes,
             data_dir: str | None) -> dict[str, str]:
    """The rank's whole environment: :func:`start_env` plus what the rendezvous decided."""
    env = start_env(spec)
    # The task's CPUs (its resource profile's, or spark.task.cpus on a cluster); on a local
    # master or in local mode, the CPUs its affinity mask and cgroup quota leave, shared among
    # this host's ranks.
    usable = cpus.usable_cpus()
    threads = cpus.rank_threads(spec.task_cpus, usable, topo["local_size"])
    gpu_ids = _gpu_ids(spec, rank, gpu_addresses)
    env.update(build_worker_env(
        rank=rank, hosts=hosts, ports=ports, master_port=master_port,
        gpu_ids=gpu_ids, run_id=spec.run_id, user_env=spec.user_env,
        attempt=spec.attempt, max_attempts=spec.max_attempts, threads=threads,
    ))
    if spec.backend == "jax":
        env.update(jax_env.jax_env(hosts, rank, master_port, gpu_ids, spec.jax_cpu_devices))
        env.update(jax_env.xla_thread_defaults(threads, gpu_ids, env))  # unless the user or executor set XLA_FLAGS
    elif spec.backend is not None:
        env["KERAS_BACKEND"] = spec.backend
    env.update(cpus.thread_defaults(threads, spec.user_env))
    env[we.CPU_BUDGET] = str(cpus.host_budget(spec.task_cpus, topo["local_size"], usable))
    cores = _pinned_cores(spec, topo)
    if cores:
        env[we.CORES] = ",".join(map(str, cores))
    env.update(tracking.rank_env(rank, spec.mlflow, workdir))
    env["PYTHONPATH"] = _child_pythonpath()
    env[we.COLLECTIVE_KEY_FILE] = _write_key(workdir, key)
    env[we.PROGRESS_FILE] = os.path.join(workdir, "progress")
    if data_dir is not None:
        env[we.DATA_DIR] = data_dir
    return env


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
    gpu_ids : the value for ``CUDA_VISIBLE_DEVICES`` (``host.gpus.translate_gpu_ids``).
    run_id : the run's id.
    user_env : the ``env`` passed to ``run``; reserved names are refused earlier, on the driver.
    attempt : which attempt of the run this is, 1-based.
    max_attempts : how many attempts the run has in all, as ``SPARKTRAIN_ATTEMPTS_ALLOWED``.
    threads : the rank's compute threads (``host.cpus.rank_threads``), as ``SPARKTRAIN_THREADS``.

    Examples
    --------
    >>> env = build_worker_env(rank=1, hosts=["h", "h"], ports=[5000, 5001], master_port=5002,
    ...                        gpu_ids="-1", run_id="r")
    >>> env["SPARKTRAIN_LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]
    ('1', 'h', '5002')
    """
    if len(hosts) != len(ports):
        raise ValueError(f"got {len(hosts)} hosts but {len(ports)} ports")
    t = topology.topology(hosts, rank)
    # Output must reach the driver line by line, not when an 8 KiB buffer fills.
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(user_env or {})
    env.update({
        we.RANK: str(t["rank"]),
        we.SIZE: str(t["size"]),
        we.LOCAL_RANK: str(t["local_rank"]),
        we.LOCAL_SIZE: str(t["local_size"]),
        we.CROSS_RANK: str(t["cross_rank"]),
        we.CROSS_SIZE: str(t["cross_size"]),
        we.RUN_ID: run_id,
        we.ATTEMPT: str(attempt),
        we.MAX_ATTEMPTS: str(max_attempts),
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
        env[we.THREADS] = str(threads)
    return env


def _write_key(workdir: str, key: bytes) -> str:
    path = os.path.join(workdir, "collective.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return path


def _pinned_cores(spec, topo: Mapping[str, int]) -> list[int] | None:
    """The cores this rank keeps to, or None. By default ("auto") only where the ranks own the
    machine: local mode and local masters, whose task CPUs are not counted (``spec.task_cpus`` None)."""
    mode = rank_settings.parse({**os.environ, **spec.user_env}).pin_cores
    if mode == "off" or (mode == "auto" and spec.task_cpus is not None) or not hasattr(os, "sched_getaffinity"):
        return None
    return cpus.rank_cores(sorted(os.sched_getaffinity(0)), topo["local_rank"], topo["local_size"])


def _child_pythonpath() -> str:
    """The child must import what this worker imports: sparktrain, and files shipped with
    sc.addPyFile, which live on this worker's sys.path but not in PYTHONPATH.

    Jars are left out: Spark puts its core jar on the Python workers' path, but since Spark 2 it
    holds no Python (pyspark.zip does), and addPyFile takes .py, .zip and .egg files only. Every
    rank process would read the jar's directory of some thousands of entries at start-up, before
    its first import.
    """
    parts = [p for p in sys.path if p and not p.endswith(".jar") and os.path.exists(p)]
    parts += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not p.endswith(".jar")]
    return os.pathsep.join(dict.fromkeys(parts))


def _gpu_ids(spec: TaskSpec, rank: int, gpu_addresses: Sequence[str] | None) -> str:
    if not spec.use_gpu:
        return gpus.NO_GPU
    if not gpu_addresses:
        raise SparkTrainError(
            f"use_gpu=True but Spark assigned no GPU to rank {rank}'s task; set "
            "spark.task.resource.gpu.amount=1 and spark.executor.resource.gpu.amount on the cluster"
        )
    return gpus.translate_gpu_ids(list(gpu_addresses), os.environ.get("CUDA_VISIBLE_DEVICES"))


