"""Keras data-parallel training with Horovod's ``horovod.tensorflow.keras`` API: Keras 3, and tf_keras
(Keras 2) where ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` tf_keras.

Inside ``train_fn``::

    import keras
    import sparktrain.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_shard, y_shard, batch_size=64, epochs=5, verbose=1 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
    hvd.save_model(model, "/dbfs/models/model.keras")   # every rank may call it; rank 0 writes

Gradients are averaged across ranks inside ``model.fit``'s compiled train step, in one fused
collective per dtype. Keras 3 runs without any tf.distribute strategy scope.

By role: ``optimizer`` (``DistributedOptimizer``, ``PartialDistributedOptimizer``),
``callbacks`` (broadcast, metric averaging, learning-rate warm-up and schedule, checkpoints),
``SyncBatchNormalization``, ``elastic`` (state that outlives a failed
attempt) and ``tracking`` (MLflow, TensorBoard); the collectives and ``Compression`` are
``sparktrain.tensorflow``'s. Each name here hands its call on to the front that serves this process's
Keras (``fronts``: Keras 3 on TensorFlow, tf_keras, or Keras 3 on JAX), which ``kerasline.front``
names; ``DistributedOptimizer`` goes to the front of the optimizer's own line.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from .. import kerasline
from ..host.localfiles import replaced_atomically
# The front that serves this process's Keras (``fronts``: Keras 3 on TensorFlow, tf_keras, or Keras 3
# on JAX), chosen once, in ``kerasline``, and its backend, which the callbacks are built for.
from .front import backend as _backend, served as _front
from . import callbacks

if _backend.elastic:  # hvd.elastic, as in Horovod (on TensorFlow)
    from . import elastic  # noqa: F401

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "ProcessSet", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allreduce", "broadcast", "broadcast_global_variables",
    "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "load_model", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "remove_process_set", "restore", "rocm_built", "save_model", "shutdown", "size", "start_timeline",
    "stop_timeline",
]

#: The reduction ops, the compressions and the process sets of the front's collectives.
Average, Sum, Compression = _front.Average, _front.Sum, _front.Compression
ProcessSet, global_process_set = _front.ProcessSet, _front.global_process_set
#: Horovod's synchronized batch normalization, a layer class of the served Keras.
SyncBatchNormalization = _front.SyncBatchNormalization


def _front_doc(name: str) -> Callable:
    """Give the decorated function the front's ``name``'s docstring, and its signature to ``help``."""

    def document(function: Callable) -> Callable:
        served = getattr(_front, name)
        function.__doc__, function.__wrapped__ = served.__doc__, served
        return function

    return document


@_front_doc("init")
def init(*args, **kwargs):
    return _front.init(*args, **kwargs)


@_front_doc("shutdown")
def shutdown():
    return _front.shutdown()


@_front_doc("is_initialized")
def is_initialized():
    return _front.is_initialized()


@_front_doc("rank")
def rank():
    return _front.rank()


@_front_doc("size")
def size():
    return _front.size()


@_front_doc("local_rank")
def local_rank():
    return _front.local_rank()


@_front_doc("local_size")
def local_size():
    return _front.local_size()


@_front_doc("cross_rank")
def cross_rank():
    return _front.cross_rank()


@_front_doc("cross_size")
def cross_size():
    return _front.cross_size()


@_front_doc("allreduce")
def allreduce(*args, **kwargs):
    return _front.allreduce(*args, **kwargs)


@_front_doc("allgather")
def allgather(*args, **kwargs):
    return _front.allgather(*args, **kwargs)


@_front_doc("broadcast")
def broadcast(*args, **kwargs):
    return _front.broadcast(*args, **kwargs)


@_front_doc("reducescatter")
def reducescatter(*args, **kwargs):
    return _front.reducescatter(*args, **kwargs)


@_front_doc("broadcast_variables")
def broadcast_variables(*args, **kwargs):
    return _front.broadcast_variables(*args, **kwargs)


@_front_doc("broadcast_global_variables")
def broadcast_global_variables(root_rank: int):
    return _front.broadcast_global_variables(root_rank)


@_front_doc("add_process_set")
def add_process_set(*args, **kwargs):
    return _front.add_process_set(*args, **kwargs)


@_front_doc("remove_process_set")
def remove_process_set(*args, **kwargs):
    return _front.remove_process_set(*args, **kwargs)


@_front_doc("start_timeline")
def start_timeline(*args, **kwargs):
    return _front.start_timeline(*args, **kwargs)


@_front_doc("stop_timeline")
def stop_timeline():
    return _front.stop_timeline()


@_front_doc("load_model")
def load_model(*args, **kwargs):
    return _front.load_model(*args, **kwargs)


# What the collectives were built with, as Horovod's build facts.
@_front_doc("mpi_built")
def mpi_built():
    return _front.mpi_built()


@_front_doc("mpi_enabled")
def mpi_enabled():
    return _front.mpi_enabled()


@_front_doc("mpi_threads_supported")
def mpi_threads_supported():
    return _front.mpi_threads_supported()


@_front_doc("gloo_built")
def gloo_built():
    return _front.gloo_built()


@_front_doc("gloo_enabled")
def gloo_enabled():
    return _front.gloo_enabled()


@_front_doc("nccl_built")
def nccl_built():
    return _front.nccl_built()


@_front_doc("ddl_built")
def ddl_built():
    return _front.ddl_built()


@_front_doc("ccl_built")
def ccl_built():
    return _front.ccl_built()


@_front_doc("cuda_built")
def cuda_built():
    return _front.cuda_built()


@_front_doc("rocm_built")
def rocm_built():
    return _front.rocm_built()


def save_model(model, filepath: str, **kwargs) -> str | None:
    """Save ``model`` from rank 0 only; every rank may call it and none waits for another.

    Keras 3 ``model.save`` runs no collective, so the other ranks simply return None. Returns
    the path on rank 0.
    """
    if rank() != 0:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
    with replaced_atomically(filepath) as tmp, _backend.saving():  # a reader never finds half a file
        model.save(tmp, **kwargs)
    return filepath


def restore(prefix: str, storage_options: Mapping[str, Any] | None = None, custom_objects=None):
    """Load the latest checkpoint :class:`callbacks.RemoteCheckpoint` committed under ``prefix``.

    Returns ``(model, initial_epoch)``, or ``(None, 0)`` when there is none yet, so a script can
    resume or start fresh with the same code::

        model, initial_epoch = hvd.restore("abfs://models/run1")
        if model is None:
            model = build_and_compile()
        model.fit(..., initial_epoch=initial_epoch, callbacks=[..., RemoteCheckpoint(...)])

    Every rank reads the checkpoint itself; the broadcast callback keeps them equal afterwards.
    ``custom_objects`` are the model's custom layers, losses and metrics, by name.
    """
    import tempfile

    from .. import storage

    latest = storage.latest_checkpoint(prefix, storage_options)
    if latest is None:
        return None, 0
    epoch = int(storage.read_manifest(latest, storage_options).get("metadata", {}).get("epoch", 0))
    name = latest.rstrip("/").rsplit("/", 1)[-1]
    suffix = ".h5" if name.endswith(".h5") else ".keras"
    with tempfile.TemporaryDirectory(prefix="sparktrain-restore-") as tmp:
        local = os.path.join(tmp, "model" + suffix)
        storage.get_file(latest, local, storage_options)
        return load_model(local, custom_objects=custom_objects), epoch


@_front_doc("DistributedOptimizer")
def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    # The front of the optimizer's own line, which need not be the one this process serves.
    return kerasline.serving(optimizer).DistributedOptimizer(optimizer, *args, **kwargs)


@_front_doc("PartialDistributedOptimizer")
def PartialDistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    return kerasline.serving(optimizer).PartialDistributedOptimizer(optimizer, *args, **kwargs)
