"""What a rank of a JAX run finds in its environment: JAX's coordinator (written by the rank's task,
read by :func:`coordinator`), JAX's CPU platform where the rank has no GPU, and XLA's CPU threads.

Pure functions over mappings: nothing here imports JAX, so the executor builds a rank's
environment with them and the launch stays free of JAX.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from ..host.gpus import NO_GPU
from ..seam.worker_env import JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID


def coordinator(environ: Mapping[str, str] = os.environ) -> dict | None:
    """What ``jax.distributed.initialize`` takes, read from a rank's environment; None outside a JAX run.

    >>> coordinator({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h:5", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    ...              "KERAS_DISTRIBUTION_PROCESS_ID": "1"})
    {'coordinator_address': 'h:5', 'num_processes': 2, 'process_id': 1}
    """
    if JAX_COORDINATOR not in environ:
        return None
    return {"coordinator_address": environ[JAX_COORDINATOR].split(",")[0],
            "num_processes": int(environ[JAX_NUM_PROCESSES]),
            "process_id": int(environ[JAX_PROCESS_ID])}


def processes(environ: Mapping[str, str] = os.environ) -> int:
    """The number of processes of the JAX run (1 outside one)."""
    return int(environ.get(JAX_NUM_PROCESSES, "1"))


def xla_thread_defaults(threads: int, gpu_ids: str, env: Mapping[str, str]) -> dict[str, str]:
    """XLA's CPU threads for a JAX rank without a GPU: its CPU client's thread pools sized to the
    rank's ``threads`` (``PJRT_NPROC``), where the rank shows one CPU device and ``env`` sets
    neither ``PJRT_NPROC`` nor ``NPROC``; and, unless ``env`` sets ``XLA_FLAGS``, Eigen's thread
    pool off (each op on the calling thread) for a rank that has one core's share.

    XLA starts its pools with a thread per core of the machine, in every rank, and they spin
    looking for work, taking the CPU that the ranks beside them need for their own steps; so
    each rank's pools get its share, as TensorFlow's do (``host.cpus.thread_defaults``), and a
    rank with one core's share runs each op on the calling thread. A rank with more CPU devices
    keeps XLA's pools: each device's computation may need a thread while another waits in a
    collective.

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
