"""The rank process's environment, built once, after the rendezvous.

The held rank process starts before the rendezvous with :func:`start_env`: the executor's own
environment, the user's ``env`` and the import path, all that a Python interpreter reads as it
starts. :func:`rank_env` adds what the rendezvous decides (topology, ports, threads, cores, GPUs,
the collective key, the spool, MLflow's hand-off); the process takes it whole at its go.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from ..engine import kernel_cache
from ..host import cpus
from ..settings import rank as rank_settings
from ..seam import tracking, worker_env
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
    threads = worker_env.rank_threads(spec.task_cpus, usable, topo["local_size"])
    gpu_ids = _gpu_ids(spec, rank, gpu_addresses)
    env.update(worker_env.build_worker_env(
        rank=rank, hosts=hosts, ports=ports, master_port=master_port,
        gpu_ids=gpu_ids, run_id=spec.run_id, user_env=spec.user_env,
        attempt=spec.attempt, max_attempts=spec.max_attempts, threads=threads,
    ))
    if spec.backend == "jax":
        env.update(worker_env.jax_env(hosts, rank, master_port, gpu_ids, spec.jax_cpu_devices))
        env.update(worker_env.xla_thread_defaults(threads, gpu_ids, env))  # unless the user or executor set XLA_FLAGS
    elif spec.backend is not None:
        env["KERAS_BACKEND"] = spec.backend
    env.update(worker_env.thread_defaults(threads, spec.user_env))
    env[worker_env.CPU_BUDGET] = str(cpus.host_budget(spec.task_cpus, topo["local_size"], usable))
    cores = _pinned_cores(spec, topo)
    if cores:
        env[worker_env.CORES] = ",".join(map(str, cores))
    env.update(tracking.rank_env(rank, spec.mlflow, workdir))
    env["PYTHONPATH"] = _child_pythonpath()
    env[worker_env.COLLECTIVE_KEY_FILE] = _write_key(workdir, key)
    env[worker_env.PROGRESS_FILE] = os.path.join(workdir, "progress")
    if data_dir is not None:
        env[worker_env.DATA_DIR] = data_dir
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
    return worker_env.rank_cores(sorted(os.sched_getaffinity(0)), topo["local_rank"], topo["local_size"])


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
        return worker_env.NO_GPU
    if not gpu_addresses:
        raise SparkTrainError(
            f"use_gpu=True but Spark assigned no GPU to rank {rank}'s task; set "
            "spark.task.resource.gpu.amount=1 and spark.executor.resource.gpu.amount on the cluster"
        )
    return worker_env.translate_gpu_ids(list(gpu_addresses), os.environ.get("CUDA_VISIBLE_DEVICES"))


