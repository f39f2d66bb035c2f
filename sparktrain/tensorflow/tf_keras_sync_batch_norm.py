"""Horovod's ``SyncBatchNormalization`` for tf_keras (Keras 2): batch moments over every rank's batch."""
from __future__ import annotations

import tensorflow as tf
import tf_keras

from . import runtime
from .moments import summed_over_ranks


class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` (tf_keras) whose training-time mean and variance are
    those of the global batch, every rank's batch together, as the Keras 3 layer of the same name
    (``sparktrain.tensorflow.sync_batch_norm``). It never takes tf_keras' fused kernel, which computes
    the moments of the local batch inside one op; ``fused=True`` is refused, as Horovod refused it."""

    def __init__(self, *args, fused=None, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization cannot be fused: the moments come from every rank's batch; "
                             "leave fused unset (or False)")
        super().__init__(*args, fused=False, **kwargs)

    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        if runtime.size() == 1:
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        # Sums in float32 at least: float16 sums of squares overflow on a large global batch.
        dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32
        x = tf.cast(inputs, dtype)
        weights = tf.ones_like(x) if mask is None else \
            tf.broadcast_to(tf.expand_dims(tf.cast(mask, dtype), axis=-1), tf.shape(x))
        local = tf.stack([tf.reduce_sum(x * weights, axis=reduction_axes, keepdims=keep_dims),
                          tf.reduce_sum(tf.square(x) * weights, axis=reduction_axes, keepdims=keep_dims),
                          tf.reduce_sum(weights, axis=reduction_axes, keepdims=keep_dims)])
        total = summed_over_ranks(local)
        count = tf.maximum(total[2], 1.0)
        mean = total[0] / count
        variance = tf.maximum(total[1] / count - tf.square(mean), 0.0)  # E[x^2] - E[x]^2, never below zero
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
