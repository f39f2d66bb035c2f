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
``sparktrain.tensorflow``'s. The names come from the front that serves this process's Keras
(``fronts``: Keras 3 on TensorFlow, tf_keras, or Keras 3 on JAX), which ``kerasline.front`` names;
``DistributedOptimizer`` goes to the front of the optimizer's own line.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

from .. import kerasline
from ..errors import InvalidArgumentError
from ..host.localfiles import replaced_atomically
# The front that serves this process's Keras (``fronts``: Keras 3 on TensorFlow, tf_keras, or Keras 3
# on JAX), chosen once, in ``kerasline``, and its backend, which the callbacks are built for.
from .front import backend as _backend, served as _front
from . import callbacks  # noqa: F401

if _backend.elastic:  # hvd.elastic, as in Horovod (on TensorFlow)
    from . import elastic  # noqa: F401


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1 call, which TensorFlow 2 has no meaning for: there is no global collection of
    variables to broadcast. As Horovod does under TensorFlow 2, this raises and names what to use.
    """
    raise InvalidArgumentError(
        f"broadcast_global_variables({root_rank!r}) has no meaning in TensorFlow 2 (there are no global "
        "variables); use callbacks.BroadcastGlobalVariablesCallback(root_rank) with model.fit, or "
        "broadcast_variables(model.variables + optimizer.variables, root_rank) in a custom loop")


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


def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    return importlib.import_module(kerasline.front(optimizer)).DistributedOptimizer(optimizer, *args, **kwargs)


def PartialDistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    return importlib.import_module(kerasline.front(optimizer)).PartialDistributedOptimizer(optimizer, *args, **kwargs)


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


# The front's names: its optimizers (for the objects of its line; others go to their line's front),
# SyncBatchNormalization, load_model, the collectives; on JAX, what only TensorFlow has raises.
globals().update({name: getattr(_front, name) for name in _front.__all__
                  if name not in ("DistributedOptimizer", "PartialDistributedOptimizer")})
for _routed in (DistributedOptimizer, PartialDistributedOptimizer):
    _routed.__doc__ = getattr(_front, _routed.__name__).__doc__
