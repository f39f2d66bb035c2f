"""The two names of Horovod's ``horovod.tensorflow`` that serve Keras objects: ``DistributedOptimizer``
(for Keras optimizers) and ``SyncBatchNormalization``. ``sparktrain.tensorflow`` checks Horovod's
arguments and hands the object to the front ``sparktrain.kerasline`` names for its Keras line, when
called or asked for; this layer imports nothing of the Keras layer (``sparktrain.keras``,
``sparktrain._keras``)."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .compression import Compression
from .ops import Average
from .process_sets import global_process_set

#: Horovod's defaults: only the arguments a caller changed are handed on.
_DEFAULTS = dict(name=None, device_dense="", device_sparse="", compression=Compression.none, sparse_as_dense=False,
                 backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                 average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True)


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False,  # noqa: N802 - Horovod's
                         device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups=None, process_set=global_process_set,
                         scale_local_gradients: bool = True):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer``: for a Keras optimizer, the same as
    ``sparktrain.keras.DistributedOptimizer`` (as Horovod hands Keras optimizers to its Keras
    wrapper). TensorFlow 1 optimizers (``tf.compat.v1.train.*``) are not supported: use a Keras
    optimizer, or :func:`DistributedGradientTape` in a custom loop.
    """
    from .. import kerasline

    if kerasline.line_of(optimizer) is None or not hasattr(optimizer, "apply_gradients"):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps Keras optimizers (keras.optimizers.*, or tf.keras.optimizers.* for tf_keras), "
            f"got {type(optimizer).__name__}; "
            "TensorFlow 1 optimizers are not supported: use a Keras optimizer, or DistributedGradientTape")
    given = dict(name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                 sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step, op=op,
                 gradient_predivide_factor=gradient_predivide_factor,
                 average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
                 process_set=process_set, scale_local_gradients=scale_local_gradients)
    return kerasline.serving(optimizer).DistributedOptimizer(
        optimizer, **{k: v for k, v in given.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k]})


def sync_batch_normalization() -> type:
    """``SyncBatchNormalization`` of the Keras this process serves (its front's)."""
    from .. import kerasline

    return kerasline.serving().SyncBatchNormalization
