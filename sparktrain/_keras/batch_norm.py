"""Horovod's ``SyncBatchNormalization``, written once for both Keras lines on TensorFlow: the batch
moments over every rank's batch.

:func:`sync_batch_normalization` builds the class for the Keras module a front gives it, a subclass of
that module's ``BatchNormalization``. Keras 3 asks its layer for the moments through ``_moments``,
tf_keras through ``_calculate_mean_and_var``; both hooks hand the batch to :func:`global_moments`.
"""
from __future__ import annotations

from ..tensorflow import runtime
from ..tensorflow.collectives import allreduce
from ..tensorflow.ops import Sum

_classes: dict[int, type] = {}


def summed_over_ranks(x):
    """``allreduce(x, Sum)`` with its gradient: the sum over ranks of the upstream gradients.

    Each rank's loss depends on every rank's inputs through the shared moments, so each
    input's gradient collects the contributions of all ranks.
    """
    import tensorflow as tf

    @tf.custom_gradient
    def summed(t):
        def grad(dy):
            return allreduce(dy, op=Sum)

        return allreduce(t, op=Sum), grad

    return summed(x)


def global_moments(inputs, axes, keepdims: bool = False, mask=None):
    """The mean and variance of ``inputs`` over ``axes`` and over every rank's batch together
    (``mask``: the weight of each sample, or None), in ``inputs``' dtype."""
    import tensorflow as tf

    # Sums in float32 at least: float16 sums of squares overflow on a large global batch.
    dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32
    x = tf.cast(inputs, dtype)
    weights = tf.ones_like(x) if mask is None else \
        tf.broadcast_to(tf.expand_dims(tf.cast(mask, dtype), axis=-1), tf.shape(x))
    local = tf.stack([tf.reduce_sum(x * weights, axis=axes, keepdims=keepdims),
                      tf.reduce_sum(tf.square(x) * weights, axis=axes, keepdims=keepdims),
                      tf.reduce_sum(weights, axis=axes, keepdims=keepdims)])
    total = summed_over_ranks(local)
    count = tf.maximum(total[2], 1.0)
    mean = total[0] / count
    variance = tf.maximum(total[1] / count - tf.square(mean), 0.0)  # E[x^2] - E[x]^2, never below zero
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


class _GlobalMoments:
    """What ``SyncBatchNormalization`` adds to a line's ``BatchNormalization``: ``fused`` refused."""

    #: Whether the base takes ``fused`` (tf_keras' fused kernel computes the local batch's moments).
    _sparktrain_fuses = False

    def __init__(self, *args, fused=None, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization cannot be fused: the moments come from every rank's batch; "
                             "leave fused unset (or False)")
        if self._sparktrain_fuses:
            kwargs["fused"] = False
        super().__init__(*args, **kwargs)


def _moments(self, inputs, mask):  # Keras 3's hook
    if runtime.size() == 1:
        return self._sparktrain_base._moments(self, inputs, mask)
    return global_moments(inputs, self._reduction_axes, mask=mask)


def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):  # tf_keras' hook
    if runtime.size() == 1:
        return self._sparktrain_base._calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=mask)
    return global_moments(inputs, reduction_axes, keep_dims, mask)


def sync_batch_normalization(keras, fuses: bool, module: str) -> type:
    """``SyncBatchNormalization`` for the Keras module ``keras`` (one class per module), named as
    defined in ``module`` (the front that exports it). ``fuses``: its ``BatchNormalization`` is
    tf_keras', which takes ``fused`` and asks ``_calculate_mean_and_var`` for the moments; else
    Keras 3's, which asks ``_moments``."""
    cls = _classes.get(id(keras))
    if cls is None:
        hook = {"_calculate_mean_and_var": _calculate_mean_and_var} if fuses else {"_moments": _moments}
        cls = type("SyncBatchNormalization", (_GlobalMoments, keras.layers.BatchNormalization), {
            "__module__": module, "__doc__": _DOC, "_sparktrain_fuses": fuses,
            "_sparktrain_base": keras.layers.BatchNormalization, **hook})
        _classes[id(keras)] = cls
    return cls


_DOC = """``BatchNormalization`` whose training-time mean and variance are those of the global batch: every
rank's batch together, as if they were one.

Each training call runs one allreduce of the per-channel sums, sums of squares and counts (every
rank must call the layer the same number of times, as ``model.fit`` does). At inference it is a
plain BatchNormalization with its moving statistics, which stay equal on every rank. With one rank
it is BatchNormalization. Ranks may have batches of different sizes. It never takes tf_keras' fused
kernel, which computes the moments of the local batch inside one op: ``fused=True`` is refused, as
Horovod refused it. Horovod exports it as ``hvd.SyncBatchNormalization`` from both
``horovod.tensorflow`` and ``horovod.tensorflow.keras``; so do ``sparktrain.tensorflow`` and
``sparktrain.keras``."""
