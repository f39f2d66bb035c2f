"""The callbacks of Horovod's elastic Keras API (``hvd.elastic``), written once: they keep an elastic
``State`` current during ``model.fit``, on TensorFlow (``sparktrain.tensorflow.elastic``), and are
built for the backend's Keras by ``backend.classes`` (``sparktrain.keras.elastic``)."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from ..tensorflow import resize
from ..tensorflow.elastic import State


class CommitStateCallbackImpl:
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch.

    Each commit with the ``elastic_url`` setting writes the model and optimizer (rank 0), so pick
    ``batches_per_commit`` to make that a small part of the time. Under ``run_elastic`` it also
    commits at the end of the step in which the driver asked for a new size (an executor being
    decommissioned, or free slots for more ranks), so that the attempt ends losing no step: one
    small broadcast a step, from rank 0, says whether it did (``sparktrain.tensorflow.resize``).
    """

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise InvalidArgumentError(f"batches_per_commit must be a whole number of at least 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0 or resize.requested():
            self.state.commit()  # raises HostsUpdatedInterrupt when a new size was asked for
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallbackImpl:
    """Keep ``state.batch`` at the last finished batch of the epoch (0 after the epoch).

    Horovod also lowers ``params["steps"]`` so a resumed epoch runs only its remaining batches;
    this does the same, but Keras 3 takes the number of steps from its data iterator, not from
    ``params``, so a resumed epoch runs in full (from the committed weights).
    """

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallbackImpl:
    """Keep ``state.epoch`` at the number of finished epochs, counted across resumes: Keras counts
    from ``initial_epoch``, or from 0 when it is not given, so the count starts from the state's
    epoch at the start of training."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch
        self._keras_initial = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._keras_initial is None:
            self._keras_initial = epoch  # fit(initial_epoch=state.epoch) starts Keras's count there

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + (epoch - (self._keras_initial or 0)) + 1


IMPLS = [CommitStateCallbackImpl, UpdateBatchStateCallbackImpl, UpdateEpochStateCallbackImpl]
