"""Horovod's learning-rate callbacks: ``LearningRateScheduleCallback`` and ``LearningRateWarmupCallback``,
for the Keras of the backend they are built for (``backend.classes``)."""
from __future__ import annotations

from .. import context as _ctx, kerasline
from ..errors import InvalidArgumentError


class LearningRateScheduleCallbackImpl:
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until ``end_epoch``.

    Horovod's schedule (Goyal et al., "Accurate, Large Minibatch SGD"):

    - ``multiplier``: a function of the epoch, or a number m meaning ``m ** (epoch - start_epoch)``
      (exponential decay).
    - ``staircase=True``: the rate changes at the first batch of each epoch, with the whole epoch;
      ``False``: at every batch, with the fractional epoch ``epoch + batch / steps_per_epoch``.
    - ``end_epoch``: the first epoch left alone (None: never stop).
    - ``momentum_correction``: when the rate changes from ``old`` to ``new``, the optimizer's
      momentum buffers are scaled by ``new / old``. In Keras 3 the momentum is a constant traced into
      the train step, so instead of Horovod's one-batch change of ``momentum`` the buffers it
      multiplies are scaled; for SGD (and RMSprop) with momentum the update is the same.
    - ``steps_per_epoch``: taken from ``model.fit`` when it knows it.

    The rate of each epoch is logged as ``lr``. The optimizer's ``learning_rate`` must be a number
    (a variable), not a ``LearningRateSchedule``.
    """

    def __init__(self, initial_lr: float, multiplier, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None or isinstance(initial_lr, bool) or not isinstance(initial_lr, (int, float)) \
                or not initial_lr > 0:
            raise InvalidArgumentError(f"initial_lr must be a positive number (the scaled rate), got {initial_lr!r}")
        if not callable(multiplier):
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
                raise InvalidArgumentError(f"multiplier must be a number or a function of the epoch, got {multiplier!r}")
            factor = float(multiplier)
            multiplier = lambda epoch: factor ** (epoch - start_epoch)  # noqa: E731 - Horovod's exponential decay
        if end_epoch is not None and end_epoch <= start_epoch:
            raise InvalidArgumentError(f"end_epoch ({end_epoch}) must be after start_epoch ({start_epoch}), or None")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise InvalidArgumentError(f"{type(self).__name__} needs steps_per_epoch= when model.fit does not know "
                                      "the number of steps (a dataset of unknown length)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _in_scope(self) -> bool:
        return self.current_epoch >= self.start_epoch and (self.end_epoch is None or self.current_epoch < self.end_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_scope():
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        rate = optimizer._learning_rate if hasattr(optimizer, "_learning_rate") else optimizer.learning_rate
        legacy_hyper = kerasline.is_legacy_optimizer(optimizer)  # tf_keras' legacy ones: a number until first used
        if not hasattr(rate, "assign") and not (legacy_hyper and isinstance(rate, (int, float))):
            raise InvalidArgumentError(f"{type(self).__name__} sets the learning rate, but the optimizer's is a "
                                       f"{type(rate).__name__}; give the optimizer a number instead")
        old = self.backend.value(rate)
        new = self.initial_lr * self.multiplier(epoch)
        if hasattr(rate, "assign"):
            rate.assign(new)
        else:
            optimizer._set_hyper("learning_rate", new)
        if self.momentum_correction and old > 0 and new != old:
            _scale_momentum(optimizer, self.model, new / old, self.backend.value)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self.backend.value(self.model.optimizer.learning_rate)


def _scale_momentum(optimizer, model, ratio: float, value) -> None:
    """Goyal et al.'s momentum correction: scale the momentum buffers (which carry the rate) by ``ratio``."""
    momentum = getattr(optimizer, "momentum", 0)
    if momentum is None or not isinstance(momentum, (int, float)) and not hasattr(momentum, "dtype"):
        return
    if value(momentum) <= 0:
        return
    buffers = getattr(optimizer, "momentums", None)
    if buffers is None and "momentum" in getattr(optimizer, "get_slot_names", list)():
        buffers = []  # tf_keras' legacy SGD keeps them as slots, once it has run a step
        for var in model.trainable_variables:
            try:
                buffers.append(optimizer.get_slot(var, "momentum"))
            except KeyError:
                continue
    for buf in buffers or ():
        buf.assign(buf * ratio)


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Ramp the learning rate from ``initial_lr / size`` up to ``initial_lr`` over the first epochs.

    Large learning rates scaled by the number of ranks can diverge at the start; Horovod's
    warm-up (Goyal et al.) raises the rate linearly per batch over ``warmup_epochs``:
    ``lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`` with the fractional
    epoch. Horovod evaluates it one batch later (its first batch is slightly above
    ``initial_lr / size``); here the first batch runs at exactly ``initial_lr / size`` and the
    rate is ``initial_lr`` from the end of the last warm-up epoch.

    Parameters
    ----------
    initial_lr : the learning rate after warm-up (usually the single-process rate times size()).
    warmup_epochs : how many epochs the ramp lasts.
    momentum_correction : scale the momentum buffers with each change (see LearningRateScheduleCallback).
    steps_per_epoch : batches per epoch; taken from ``model.fit`` when it knows it.
    verbose : print the rate when warm-up ends (rank 0 only).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 1:
            raise InvalidArgumentError(f"warmup_epochs must be a whole number of at least 1, got {warmup_epochs!r}")

        def multiplier(epoch: float) -> float:
            size = _ctx.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self._adjust(float(self.warmup_epochs))
            if self.verbose and _ctx.rank() == 0:
                print(f"Epoch {epoch + 1}: finished learning-rate warm-up to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)


IMPLS = [LearningRateScheduleCallbackImpl, LearningRateWarmupCallbackImpl]
