"""What both Keras lines' ``SyncBatchNormalization`` share: a sum over the ranks with its gradient."""
from __future__ import annotations

from .collectives import allreduce
from .ops import Sum


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
