"""Keras 3 data-parallel training with Horovod's ``horovod.tensorflow.keras`` API.

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
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .. import tensorflow as _tfc
from ..errors import SparkTrainError
from ..localfiles import replaced_atomically
from ..tensorflow import Average, Sum, allgather, allreduce, broadcast, broadcast_variables  # noqa: F401
from ..tensorflow import init, local_rank, local_size, rank, size  # noqa: F401
from . import callbacks  # noqa: F401

_wrapped_classes: dict[type, type] = {}


def DistributedOptimizer(optimizer, op: str = Average):  # noqa: N802 - Horovod's name
    """Wrap a Keras 3 optimizer so every ``apply`` first averages the gradients over all ranks.

    The wrapper is a subclass of the optimizer's own class, built from its config, so
    learning-rate schedules, clipping and the optimizer's state behave as before. Gradients are
    reduced before clipping, as with Horovod.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise SparkTrainError(
            f"DistributedOptimizer needs a Keras 3 optimizer (keras.optimizers.*), got {type(optimizer).__name__}; "
            "for tf_keras use sparktrain.tensorflow.strategy()")
    _tfc.check_op(op)
    base = type(optimizer)
    if getattr(base, "_sparktrain_distributed", False):
        return optimizer
    wrapped = _distributed_class(base).from_config(optimizer.get_config())
    wrapped._sparktrain_op = op
    return wrapped


def _distributed_class(base: type) -> type:
    cls = _wrapped_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "apply": _distributed_apply,
            "_sparktrain_distributed": True,
            "__module__": base.__module__,
            "__doc__": f"{base.__name__} whose gradients are averaged over every sparktrain rank.",
        })
        _wrapped_classes[base] = cls
    return cls


def _distributed_apply(self, grads, trainable_variables=None):
    grads = _tfc.average_gradients(list(grads), getattr(self, "_sparktrain_op", Average))
    return super(type(self), self).apply(grads, trainable_variables)


def save_model(model, filepath: str, **kwargs) -> str | None:
    """Save ``model`` from rank 0 only; every rank may call it and none waits for another.

    Keras 3 ``model.save`` runs no collective, so the other ranks simply return None. Returns
    the path on rank 0.
    """
    if rank() != 0:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
    with replaced_atomically(filepath) as tmp:  # a reader never finds half a file
        model.save(tmp, **kwargs)
    return filepath


def load_model(filepath: str, **kwargs):
    """``keras.models.load_model`` whose optimizer comes back distributed, with its state.

    Keras's built-in optimizers are loaded as their DistributedOptimizer subclasses, as Horovod's
    ``hvd.load_model`` does, so training continues data-parallel where it stopped.
    """
    import keras

    custom = {}
    for name in dir(keras.optimizers):
        obj = getattr(keras.optimizers, name)
        if isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer) and obj is not keras.optimizers.Optimizer:
            custom[name] = _distributed_class(obj)
    custom.update(kwargs.pop("custom_objects", None) or {})
    return keras.models.load_model(filepath, custom_objects=custom, **kwargs)


def restore(prefix: str, storage_options: Mapping[str, Any] | None = None):
    """Load the latest checkpoint :class:`callbacks.RemoteCheckpoint` committed under ``prefix``.

    Returns ``(model, initial_epoch)``, or ``(None, 0)`` when there is none yet, so a script can
    resume or start fresh with the same code::

        model, initial_epoch = hvd.restore("abfs://models/run1")
        if model is None:
            model = build_and_compile()
        model.fit(..., initial_epoch=initial_epoch, callbacks=[..., RemoteCheckpoint(...)])

    Every rank reads the checkpoint itself; the broadcast callback keeps them equal afterwards.
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
        return load_model(local), epoch
