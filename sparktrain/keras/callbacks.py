"""Horovod's Keras callbacks, importable from here as in Horovod: broadcast and metric averaging, the
learning-rate schedule and warm-up, the checkpoints, ``BackupAndRestore`` and tracking. Each is built
once from its implementation in ``sparktrain._keras``, over the ``Callback`` of the Keras this process
serves (Keras 3 on TensorFlow or on JAX, or tf_keras under ``TF_USE_LEGACY_KERAS=1``)."""
from __future__ import annotations

from typing import Any, Mapping

from .._keras import backup as _backup, callbacks as _callbacks, checkpoints as _checkpoints
from .._keras import schedules as _schedules, tracking as _tracking
from .._keras.backend import classes as _build
from .front import backend as _backend

_classes = _build(_backend, [*_callbacks.IMPLS, *_schedules.IMPLS, *_checkpoints.IMPLS, *_backup.IMPLS,
                             *_tracking.IMPLS], __name__)
BroadcastGlobalVariablesCallback = _classes["BroadcastGlobalVariablesCallback"]
MetricAverageCallback = _classes["MetricAverageCallback"]
LearningRateScheduleCallback = _classes["LearningRateScheduleCallback"]
LearningRateWarmupCallback = _classes["LearningRateWarmupCallback"]
BestModelCheckpoint = _classes["BestModelCheckpoint"]
RemoteCheckpoint = _classes["RemoteCheckpoint"]
BackupAndRestore = _classes["BackupAndRestore"]
MLflowLogger = _classes["MLflowLogger"]
RemoteTensorBoard = _classes["RemoteTensorBoard"]


def save_checkpoint(model, url: str, epoch: int, storage_options: Mapping[str, Any] | None = None,
                    metrics: Mapping[str, Any] | None = None) -> str | None:
    return _checkpoints.save_checkpoint(_backend, model, url, epoch, storage_options, metrics)


save_checkpoint.__doc__ = _checkpoints.save_checkpoint.__doc__
__all__ = [*_classes, "save_checkpoint"]
