"""tf_keras (Keras 2, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``): the Horovod-on-Keras implementation
(``sparktrain._keras``) bound to ``tf_keras``, and the callbacks' backend for it (``BACKEND``)."""
from __future__ import annotations

import tf_keras

from .on_tensorflow import *  # noqa: F401,F403 - TensorFlow's collectives, Horovod's names
from . import on_tensorflow
from ... import kerasline
from ..._keras import batch_norm, compute_gradients, optimizer as _optimizer

LINE = _optimizer.Line(keras=tf_keras,
                       optimizers=kerasline.optimizer_classes(kerasline.TF_KERAS),
                       loss_scale=tf_keras.mixed_precision.LossScaleOptimizer,
                       subclass=compute_gradients.distributed_class, configured=compute_gradients.configured,
                       rewrap_loss_scale=compute_gradients.rewrap_loss_scale)
DistributedOptimizer, PartialDistributedOptimizer, load_model = _optimizer.bound(LINE)
SyncBatchNormalization = batch_norm.sync_batch_normalization(tf_keras, fuses=True, module=__name__)


class TfKerasBackend(on_tensorflow.TensorFlowBackend):
    """The callbacks' backend for tf_keras: its fit starts where ``model._training_state`` says, and
    MLflow logs its models as TensorFlow's (its keras flavour is Keras 3's)."""

    def start_at(self, model, epoch: int) -> None:
        model._training_state = _StartAt(epoch)  # where tf_keras' fit asks for its first epoch

    def clear_start(self, model) -> None:
        if isinstance(getattr(model, "_training_state", None), _StartAt):
            model._training_state = None

    def log_model(self, model, **kwargs) -> None:
        import mlflow

        mlflow.tensorflow.log_model(model, **kwargs)


class _StartAt:
    """tf_keras' ``model._training_state`` as its fit uses it: the epoch to start at, step 0."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return max(self.epoch, initial_epoch), 0


BACKEND = TfKerasBackend(tf_keras, kerasline.TF_KERAS)

__all__ = [*on_tensorflow.__all__, "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization",
           "load_model"]
