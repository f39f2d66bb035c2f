"""Keras 3 on JAX (``run(..., backend="jax")``): what keeps its meaning, with no TensorFlow imported.

Who the rank is, ``init``, ``DistributedOptimizer`` (``sparktrain.keras.jax_optimizer``) and
``load_model`` (Keras's own: keras.distribution does the reduction) work as on TensorFlow; what only
exists on the TensorFlow backend (Horovod's tensor collectives, ``PartialDistributedOptimizer``,
``SyncBatchNormalization``) raises when called, and names ``keras.distribution``.
"""
from __future__ import annotations

from ...seam.versions import require_keras_3

require_keras_3()  # before Keras is imported: Keras 2 fails here at once
import keras  # noqa: E402

from ..jax_optimizer import Average, Compression, DistributedOptimizer, Sum  # noqa: E402,F401
from ..on_jax import (TENSORFLOW_ONLY, JaxBackend, cross_rank, cross_size, init, is_initialized,  # noqa: E402,F401
                      local_rank, local_size, rank, refuse, shutdown, size)
from ... import kerasline  # noqa: E402


def load_model(filepath: str, custom_optimizers=None, custom_objects=None, compression=None, **kwargs):
    """``keras.models.load_model``: on JAX keras.distribution does the reduction, so the optimizer
    comes back as it was saved."""
    return keras.models.load_model(filepath, custom_objects=custom_objects, **kwargs)


BACKEND = JaxBackend(keras, kerasline.KERAS_3)
globals().update({name: refuse(name) for name in TENSORFLOW_ONLY})
__all__ = ["Average", "Compression", "DistributedOptimizer", "Sum", "cross_rank", "cross_size", "init",
           "is_initialized", "load_model", "local_rank", "local_size", "rank", "shutdown", "size", *TENSORFLOW_ONLY]
