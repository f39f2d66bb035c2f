"""tf_keras (Keras 2, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``): the Horovod-on-Keras implementation
(``sparktrain._keras``) bound to ``tf_keras``."""
from __future__ import annotations

import tf_keras

from .on_tensorflow import *  # noqa: F401,F403 - TensorFlow's collectives, Horovod's names
from . import on_tensorflow
from .. import elastic  # noqa: F401 - hvd.elastic, as in Horovod
from ... import kerasline
from ..._keras import batch_norm, compute_gradients, optimizer as _optimizer

LINE = _optimizer.Line(keras=tf_keras,
                       optimizers=kerasline.optimizer_classes(kerasline.TF_KERAS),
                       loss_scale=tf_keras.mixed_precision.LossScaleOptimizer,
                       subclass=compute_gradients.distributed_class, configured=compute_gradients.configured,
                       rewrap_loss_scale=compute_gradients.rewrap_loss_scale)
DistributedOptimizer, PartialDistributedOptimizer, load_model = _optimizer.bound(LINE)
SyncBatchNormalization = batch_norm.sync_batch_normalization(tf_keras, fuses=True, module=__name__)

__all__ = [*on_tensorflow.__all__, "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization",
           "elastic", "load_model"]
