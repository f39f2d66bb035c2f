"""Keras 3 on TensorFlow: the Horovod-on-Keras implementation (``sparktrain._keras``) bound to ``keras``,
and the callbacks' backend for it (``BACKEND``)."""
from __future__ import annotations

from ...seam.versions import require_keras_3

require_keras_3()  # before Keras is imported: Keras 2 fails here at once, with TensorFlow's floor too
import keras  # noqa: E402

from .on_tensorflow import *  # noqa: F401,F403 - TensorFlow's collectives, Horovod's names
from . import on_tensorflow
from ... import kerasline
from ..._keras import batch_norm, optimizer as _optimizer, update_step

LINE = _optimizer.Line(keras=keras, optimizers=kerasline.optimizer_classes(kerasline.KERAS_3),
                       loss_scale=keras.optimizers.LossScaleOptimizer, subclass=update_step.distributed_class,
                       configured=update_step.configured, rewrap_loss_scale=update_step.rewrap_loss_scale)
DistributedOptimizer, PartialDistributedOptimizer, load_model = _optimizer.bound(LINE)
SyncBatchNormalization = batch_norm.sync_batch_normalization(keras, fuses=False, module=__name__)
BACKEND = on_tensorflow.TensorFlowBackend(keras, kerasline.KERAS_3)

__all__ = [*on_tensorflow.__all__, "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization",
           "load_model"]
