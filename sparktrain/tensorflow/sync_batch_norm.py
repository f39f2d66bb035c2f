"""Horovod's ``SyncBatchNormalization`` for Keras 3: batch moments over every rank's batch."""
from __future__ import annotations

import keras

from . import runtime
from .moments import summed_over_ranks as _summed_over_ranks


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training-time mean and variance are those of the
    global batch: every rank's batch together, as if they were one.

    Each training call runs one allreduce of the per-channel sums, sums of squares and counts
    (every rank must call the layer the same number of times, as ``model.fit`` does). At
    inference it is a plain BatchNormalization with its moving statistics, which stay equal on
    every rank. With one rank it is BatchNormalization. Ranks may have batches of different
    sizes. Horovod exports it as ``hvd.SyncBatchNormalization`` from both ``horovod.tensorflow`` and
    ``horovod.tensorflow.keras``; so do ``sparktrain.tensorflow`` and ``sparktrain.keras``. It lives in
    the TensorFlow layer, which the Keras layer builds on.
    """

    def _moments(self, inputs, mask):
        if runtime.size() == 1:
            return super()._moments(inputs, mask)
        from keras import ops

        # Sums in float32 at least: float16 sums of squares overflow on a large global batch.
        dtype = "float64" if inputs.dtype == "float64" else "float32"
        x = ops.cast(inputs, dtype)
        if mask is None:
            weights = ops.ones_like(x)
        else:
            weights = ops.cast(ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(x)), dtype)
        axes = self._reduction_axes
        local = ops.stack([ops.sum(x * weights, axis=axes), ops.sum(ops.square(x) * weights, axis=axes),
                           ops.sum(weights, axis=axes)])
        total = _summed_over_ranks(local)
        count = ops.maximum(total[2], 1.0)
        mean = total[0] / count
        # E[x^2] - E[x]^2, never below zero where rounding would make it so.
        variance = ops.maximum(total[1] / count - ops.square(mean), 0.0)
        return ops.cast(mean, inputs.dtype), ops.cast(variance, inputs.dtype)
