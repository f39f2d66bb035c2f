"""JAX in a rank of a run with ``backend="jax"``, for code that does not go through Keras.

Keras users call ``keras.distribution.initialize()``, which reads the same environment. Others::

    def train():
        import jax
        import sparktrain.jax

        sparktrain.jax.initialize()      # jax.distributed.initialize from the rank's environment
        print(jax.process_index(), jax.device_count())

    sparktrain.run(train, num_proc=3, backend="jax")

The front of ``sparktrain._jax`` (``env``, ``distributed``). JAX is imported inside the functions:
``import sparktrain`` never loads it.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from ._jax import distributed as _distributed, env as _env

__all__ = ["check_mesh", "coordinator", "device_mesh", "initialize"]


def coordinator(environ: Mapping[str, str] = os.environ) -> dict | None:
    """What ``jax.distributed.initialize`` takes, read from a rank's environment; None outside a JAX run.

    >>> coordinator({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h:5", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    ...              "KERAS_DISTRIBUTION_PROCESS_ID": "1"})
    {'coordinator_address': 'h:5', 'num_processes': 2, 'process_id': 1}
    """
    return _env.coordinator(environ)


def initialize(**kwargs) -> None:
    """Call ``jax.distributed.initialize`` with this rank's coordinator, process count and id.

    Outside a run with ``backend="jax"`` (no coordinator in the environment), JAX is left a single
    process, with one warning. Keyword arguments go to ``jax.distributed.initialize`` (for example
    ``initialization_timeout``). Calling it again in the same process does nothing.

    >>> sparktrain.jax.initialize()   # doctest: +SKIP
    """
    _distributed.initialize(**kwargs)


def check_mesh(shape: Sequence[int], environ: Mapping[str, str] = os.environ, local_devices: int | None = None) -> None:
    """Refuse a device mesh of ``shape`` that does not hold exactly processes x devices per process.

    ``local_devices`` defaults to ``jax.local_device_count()``; :func:`device_mesh` checks its shape so.

    >>> check_mesh((2, 2), {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, local_devices=2)
    """
    _distributed.check_mesh(shape, environ, local_devices)


def device_mesh(shape: Sequence[int], axis_names: Sequence[str]):
    """A ``keras.distribution.DeviceMesh`` over every device of every process of the run, refused
    (:func:`check_mesh`) where ``shape`` does not hold processes x devices per process.

    The devices come process by process, so the mesh's first axis spans the processes when its
    length is their number: ``device_mesh((2, 2), ("model", "batch"))`` on 2 ranks of 2 devices
    shards what is laid out on ``"model"`` across the ranks.

    >>> mesh = sparktrain.jax.device_mesh((2, 2), ("batch", "model"))   # doctest: +SKIP
    """
    return _distributed.device_mesh(shape, axis_names)
