"""Horovod's ``horovod.tensorflow.keras.elastic`` for Keras 3 and tf_keras: ``KerasState``, ``run`` and the
callbacks that keep the state current during ``model.fit``, built for the Keras this process serves
from their implementation in ``sparktrain._keras.elastic``. ``hvd.elastic`` exists on TensorFlow only.

How state survives a failure on sparktrain (a later attempt of ``run(..., max_attempts=N)``
restores the last commit from the ``elastic_url`` setting) is described in
``sparktrain.tensorflow.elastic``. Example::

    import sparktrain.keras as hvd

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs, initial_epoch=state.epoch, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=100)])

    train(state)
"""
from __future__ import annotations

from .._keras import elastic as _elastic
from .._keras.backend import classes as _build
from ..tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State, TensorFlowKerasState,  # noqa: F401
                                  broadcast_object, run)
from .front import backend as _backend


class KerasState(TensorFlowKerasState):
    """A Keras model (Keras 3, or tf_keras under ``TF_USE_LEGACY_KERAS=1``), its optimizer and
    attributes (``epoch=0, batch=0``...), as Horovod's ``KerasState``."""


_classes = _build(_backend, _elastic.IMPLS, __name__)
CommitStateCallback = _classes["CommitStateCallback"]
UpdateBatchStateCallback = _classes["UpdateBatchStateCallback"]
UpdateEpochStateCallback = _classes["UpdateEpochStateCallback"]
