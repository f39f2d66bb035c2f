"""``jax.distributed`` and device meshes from a rank's environment (``env``), for
``sparktrain.jax``. JAX and Keras are imported inside the functions."""
from __future__ import annotations

import os
import warnings
from typing import Mapping, Sequence

from ..errors import InvalidArgumentError
from . import env


def initialize(**kwargs) -> None:
    """Call ``jax.distributed.initialize`` with this rank's coordinator, process count and id.

    Outside a run with ``backend="jax"`` (no coordinator in the environment), JAX is left a single
    process, with one warning. Keyword arguments go to ``jax.distributed.initialize`` (for example
    ``initialization_timeout``). Calling it again in the same process does nothing.

    >>> sparktrain.jax.initialize()   # doctest: +SKIP
    """
    import jax

    found = env.coordinator()
    if found is None:
        warnings.warn("sparktrain.jax.initialize(): not in a rank of sparktrain.run(..., backend='jax'); "
                      "JAX stays one process", RuntimeWarning, stacklevel=3)
        return
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(**found, **kwargs)


def check_mesh(shape: Sequence[int], environ: Mapping[str, str] = os.environ, local_devices: int | None = None) -> None:
    """Refuse a device mesh of ``shape`` that does not hold exactly processes x devices per process.

    Call it before anything trains (:func:`device_mesh` does); ``local_devices`` defaults to
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
    processes = env.processes(environ)
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
