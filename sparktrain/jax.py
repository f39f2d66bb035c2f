"""JAX in a rank of a run with ``backend="jax"``, for code that does not go through Keras.

Keras users call ``keras.distribution.initialize()``, which reads the same environment. Others::

    def train():
        import jax
        import sparktrain.jax

        sparktrain.jax.initialize()      # jax.distributed.initialize from the rank's environment
        print(jax.process_index(), jax.device_count())

    sparktrain.run(train, num_proc=3, backend="jax")

JAX is imported inside the functions: ``import sparktrain`` never loads it.
"""
from __future__ import annotations

import os
import warnings
from typing import Mapping, Sequence

from .seam import worker_env
from .errors import InvalidArgumentError, SparkTrainError


def coordinator(environ: Mapping[str, str] = os.environ) -> dict | None:
    """What ``jax.distributed.initialize`` takes, read from a rank's environment; None outside a JAX run.

    >>> coordinator({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h:5", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    ...              "KERAS_DISTRIBUTION_PROCESS_ID": "1"})
    {'coordinator_address': 'h:5', 'num_processes': 2, 'process_id': 1}
    """
    if worker_env.JAX_COORDINATOR not in environ:
        return None
    return {"coordinator_address": environ[worker_env.JAX_COORDINATOR].split(",")[0],
            "num_processes": int(environ[worker_env.JAX_NUM_PROCESSES]),
            "process_id": int(environ[worker_env.JAX_PROCESS_ID])}


def initialize(**kwargs) -> None:
    """Call ``jax.distributed.initialize`` with this rank's coordinator, process count and id.

    Outside a run with ``backend="jax"`` (no coordinator in the environment), JAX is left a single
    process, with one warning. Keyword arguments go to ``jax.distributed.initialize`` (for example
    ``initialization_timeout``). Calling it again in the same process does nothing.

    >>> sparktrain.jax.initialize()   # doctest: +SKIP
    """
    import jax

    found = coordinator()
    if found is None:
        warnings.warn("sparktrain.jax.initialize(): not in a rank of sparktrain.run(..., backend='jax'); "
                      "JAX stays one process", RuntimeWarning, stacklevel=2)
        return
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(**found, **kwargs)


def check_mesh(shape: Sequence[int], environ: Mapping[str, str] = os.environ, local_devices: int | None = None) -> None:
    """Refuse a device mesh of ``shape`` that does not hold exactly processes x devices per process.

    Call it before anything trains (``sparktrain.keras.mesh`` does); ``local_devices`` defaults to
    ``jax.local_device_count()``.

    >>> check_mesh((2, 2), {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, local_devices=2)
    >>> check_mesh((4, 2), {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, local_devices=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sparktrain.errors.InvalidArgumentError: a device mesh of shape (4, 2) holds 8 devices, but this run has 2 ...
    """
    if local_devices is None:
        import jax

        local_devices = jax.local_device_count()
    processes = int(environ.get(worker_env.JAX_NUM_PROCESSES, "1"))
    shape = tuple(int(n) for n in shape)
    total = 1
    for n in shape:
        total *= n
    have = processes * local_devices
    if not shape or min(shape) < 1 or total != have:
        raise InvalidArgumentError(
            f"a device mesh of shape {shape} holds {total} devices, but this run has {processes} process(es) x "
            f"{local_devices} device(s) each = {have}; give the mesh a shape whose product is {have}, for "
            f"example ({processes}, {local_devices}), or change the devices per rank (on CPU: "
            "spark.sparktrain.jaxCpuDevices or JAX_NUM_CPU_DEVICES in the driver's environment)")


def device_mesh(shape: Sequence[int], axis_names: Sequence[str]):
    """A ``keras.distribution.DeviceMesh`` over every device of every process of the run, refused
    (:func:`check_mesh`) where ``shape`` does not hold processes x devices per process.

    The devices come process by process, so the mesh's first axis spans the processes when its
    length is their number: ``device_mesh((2, 2), ("model", "batch"))`` on 2 ranks of 2 devices
    shards what is laid out on ``"model"`` across the ranks.

    >>> mesh = sparktrain.jax.device_mesh((2, 2), ("batch", "model"))   # doctest: +SKIP
    """
    import keras

    check_mesh(shape)
    return keras.distribution.DeviceMesh(tuple(shape), list(axis_names), devices=keras.distribution.list_devices())


def not_on_jax(what: str) -> SparkTrainError:
    """The error of a TensorFlow-only part of the API called on the JAX backend."""
    return SparkTrainError(
        f"{what} works on the TensorFlow backend only; this rank runs Keras on JAX. On JAX, "
        "keras.distribution does the collectives: keras.distribution.initialize(), then "
        "keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False)) "
        "(docs/jax.md)")
