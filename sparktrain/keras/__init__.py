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
``SyncBatchNormalization`` (from ``sparktrain.tensorflow``), ``elastic`` (state that outlives a failed
attempt) and ``tracking`` (MLflow, TensorBoard); the collectives and ``Compression`` are
``sparktrain.tensorflow``'s.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .. import kerasline
from ..seam.versions import require_keras_3
from . import on_jax as _jax

if not kerasline.legacy_requested():  # tf_keras (TF_USE_LEGACY_KERAS=1) is Keras 2 by design
    require_keras_3()  # before Keras is imported: Keras 2 fails here at once, with TensorFlow's floor too
if _jax.on_jax():
    from .on_jax import (cross_rank, cross_size, init, is_initialized, local_rank, local_size, rank,  # noqa: F401
                         shutdown, size)
    from ..errors import InvalidArgumentError
    from ..host.localfiles import replaced_atomically
    from . import callbacks  # noqa: F401
    from .jax_optimizer import Average, Compression, DistributedOptimizer, Sum  # noqa: F401
else:  # an older TensorFlow under Keras 3 fails in sparktrain.tensorflow's import, with the version and the fix
    from ..errors import InvalidArgumentError
    from ..host.localfiles import replaced_atomically
    from ..tensorflow import Average, Sum, allgather, allreduce, broadcast, broadcast_variables  # noqa: F401
    from ..tensorflow import (Compression, ProcessSet, add_process_set, cross_rank, cross_size,  # noqa: F401
                              global_process_set, init, is_initialized, local_rank, local_size, rank, reducescatter,
                              remove_process_set, shutdown, size, start_timeline, stop_timeline)
    from ..tensorflow import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,  # noqa: F401
                              mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
    from . import callbacks, elastic  # noqa: F401
    from ..tensorflow.keras_optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: F401
                                              _distributed_class)
    if kerasline.legacy_requested():
        from ..tensorflow.tf_keras_sync_batch_norm import SyncBatchNormalization  # noqa: F401
    else:
        from ..tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401


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
    with replaced_atomically(filepath) as tmp, _jax.saving():  # a reader never finds half a file
        model.save(tmp, **kwargs)
    return filepath


def load_model(filepath: str, custom_optimizers=None, custom_objects=None, compression=None, **kwargs):
    """``keras.models.load_model`` whose optimizer comes back distributed, with its state.

    Keras's built-in optimizers, and the classes in ``custom_optimizers``, are loaded as their
    DistributedOptimizer subclasses, as Horovod's ``hvd.load_model`` does, so training continues
    data-parallel where it stopped; ``compression`` applies to its gradients (default none). On
    JAX, where keras.distribution does the reduction, it is ``keras.models.load_model``.
    """
    from .front import keras

    if _jax.on_jax():
        return keras.models.load_model(filepath, custom_objects=custom_objects, **kwargs)
    compression = Compression.none if compression is None else compression

    from ..tensorflow.keras_optimizer import GradientReduction, _check_arguments

    _check_arguments(None, compression, False, 1.0, Average, 1, False, 0, None, None, True)
    distributed = _distributed_class
    if kerasline.served() == kerasline.TF_KERAS:
        from ..tensorflow.tf_keras_optimizer import distributed_class as distributed
    custom = {}
    for name in dir(keras.optimizers):
        obj = getattr(keras.optimizers, name)
        if isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer) and obj is not keras.optimizers.Optimizer:
            custom[name] = distributed(obj)
    for cls in custom_optimizers or []:
        custom[cls.__name__] = distributed(cls)
    custom.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=custom, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # tf_keras' loss scale keeps it inside
    if optimizer is not None and getattr(type(optimizer), "_sparktrain_distributed", False):
        # Keras 3 saved backward_passes_per_step as gradient_accumulation_steps (tf_keras has none);
        # the rest is Horovod's defaults.
        optimizer._sparktrain_reduction = GradientReduction(
            compression=compression, backward_passes_per_step=getattr(optimizer, "gradient_accumulation_steps", 0) or 1)
    return model


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


if _jax.on_jax():  # what only the TensorFlow backend has raises, and names keras.distribution
    globals().update({name: _jax.refuse(name) for name in _jax.TENSORFLOW_ONLY})
