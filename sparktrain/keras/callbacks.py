"""Keras 3 callbacks with Horovod's names: broadcast, metric averaging, learning-rate warm-up."""
from __future__ import annotations

from typing import Any, Mapping

import keras

from .. import context as _ctx
from ..errors import InvalidArgumentError, SparkTrainError
from .on_jax import refuse_on_jax as _refuse_on_jax, saving as _saving, tensorflow_collectives as _tfc


def check_equal_steps(steps) -> None:
    """Fail fast, on every rank, when ranks would run different numbers of steps per epoch.

    A rank that runs out of batches early would leave the others waiting in a gradient
    collective until it times out. sparktrain raises instead of equalizing: silently dropping or
    repeating a rank's batches changes what is trained on.
    """
    import tensorflow as tf

    known = -1 if steps is None else int(steps)
    everyone = [int(s) for s in _tfc().allgather(tf.constant([known], tf.int64)).numpy()]
    if len(set(everyone)) > 1:
        listing = ", ".join(f"rank {r}: {'unknown' if s < 0 else s}" for r, s in enumerate(everyone))
        good = [s for s in everyone if s >= 0]
        raise SparkTrainError(
            f"ranks have different numbers of steps per epoch ({listing}); they would wait for each other in "
            f"the gradient allreduce. Give every rank the same number of batches: shard with "
            f"x[rank::size] after dropping the remainder, or pass steps_per_epoch={min(good) if good else 'N'} "
            "to model.fit")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make the model and optimizer state equal to ``root_rank``'s on every rank.

    The model's variables are broadcast before training starts, so every rank begins from the
    same weights even if they were initialized differently; after the first batch, the
    optimizer's state (created lazily by Keras) is broadcast too. At the start it also checks
    that every rank will run the same number of steps per epoch.

    Variables local to each rank are never broadcast: those in ``local_variables`` (a variable
    or a list), those given to :meth:`register_local_var`, and those the model's
    ``DistributedOptimizer`` keeps local (``register_local_var``, ``PartialDistributedOptimizer``'s
    ``local_layers``). ``device`` is accepted for Horovod's signature and ignored.

    Under a ``mixed_float16`` policy, the ``LossScaleOptimizer`` that ``model.compile`` put around
    a DistributedOptimizer is made to skip overflowing steps on every rank together (see
    ``DistributedOptimizer``).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        _refuse_on_jax("callbacks.BroadcastGlobalVariablesCallback")
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [type(v).__name__ for v in local_variables if not _is_variable(v)]
        if bad:
            raise InvalidArgumentError(f"local_variables must be variables (keras.Variable or tf.Variable), got "
                                  f"{', '.join(bad)}; pass layer.weights for a whole layer")
        self._local_vars = {id(v): v for v in local_variables}
        self._done_first_batch = False

    def register_local_var(self, var) -> None:
        """Never broadcast ``var``: it stays each rank's own."""
        if not _is_variable(var):
            raise InvalidArgumentError(f"register_local_var takes a variable, got {type(var).__name__}")
        self._local_vars[id(var)] = var

    def _global(self, variables) -> list:
        from ..tensorflow.keras_optimizer import local_variables

        local = set(self._local_vars)
        local.update(id(v) for v in local_variables(getattr(self.model, "optimizer", None)))
        return [v for v in variables if id(v) not in local]

    def on_train_begin(self, logs=None):
        from ..tensorflow.keras_optimizer import agree_on_overflow

        _tfc().init()
        check_equal_steps(self.params.get("steps") if self.params else None)
        agree_on_overflow(self.model)
        _tfc().broadcast_variables(self._global(self.model.variables), self.root_rank)
        self._done_first_batch = False

    def on_train_batch_end(self, batch, logs=None):
        if self._done_first_batch:
            return
        self._done_first_batch = True
        _tfc().broadcast_variables(self._global(list(self.model.variables) + list(self.model.optimizer.variables)),
                                 self.root_rank)


def _is_variable(v) -> bool:
    import tensorflow as tf

    # A layer's variables are the backend's Variable class: keras.Variable itself from Keras 3.6
    # or so, its base before (3.2-3.5 export a subclass of it as keras.Variable). The class right
    # after keras.Variable in its MRO is that backend class in every release.
    return isinstance(v, (keras.Variable.__mro__[1], keras.Variable, tf.Variable))


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics with their average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping), so they see the
    averaged values. Every rank must report the same metric names. ``device`` is accepted for
    Horovod's signature and ignored.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        _refuse_on_jax("callbacks.MetricAverageCallback")  # on JAX, metrics are the global batch's already
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        import tensorflow as tf

        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype"))
        if not names:
            return
        values = _tfc().allreduce(tf.constant([float(logs[k]) for k in names], tf.float64), op=_tfc().Average)
        for k, v in zip(names, values.numpy().tolist()):
            logs[k] = v


class LearningRateScheduleCallback(keras.callbacks.Callback):
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
        if not hasattr(rate, "assign"):
            raise InvalidArgumentError(f"{type(self).__name__} sets the learning rate, but the optimizer's is a "
                                  f"{type(rate).__name__}; give the optimizer a number instead")
        old = float(keras.ops.convert_to_numpy(rate))
        new = self.initial_lr * self.multiplier(epoch)
        rate.assign(new)
        if self.momentum_correction and old > 0 and new != old:
            _scale_momentum(optimizer, new / old)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _scale_momentum(optimizer, ratio: float) -> None:
    """Goyal et al.'s momentum correction: scale the momentum buffers (which carry the rate) by ``ratio``."""
    momentum = getattr(optimizer, "momentum", 0)
    buffers = getattr(optimizer, "momentums", None)
    if not isinstance(momentum, (int, float)) or momentum <= 0 or not buffers:
        return
    for buf in buffers:
        buf.assign(buf * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
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


class BestModelCheckpoint(keras.callbacks.Callback):
    """Keep the best model seen so far at ``filepath``: rank 0 saves it whenever ``monitor`` improves.

    Horovod's callback (``monitor``, ``verbose``, ``save_weights_only``, ``mode``, ``save_freq``)
    takes its path from the Spark estimator that sets ``filepath``, and so does
    ``sparktrain.ml.KerasEstimator(checkpoint_callback=...)``; elsewhere pass ``filepath=`` yourself
    (a local or mounted path ending in ``.keras``, or ``.weights.h5`` with
    ``save_weights_only=True``), or set ``callback.filepath`` before ``fit``. It is Keras's
    ``ModelCheckpoint(save_best_only=True)`` on rank 0; other ranks neither write nor wait. Put it
    after ``MetricAverageCallback`` so the monitored value is the average over ranks.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq="epoch", filepath: str | None = None):
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise InvalidArgumentError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.verbose = verbose
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.save_freq = save_freq
        self.filepath = filepath
        self._inner: keras.callbacks.ModelCheckpoint | None = None

    @property
    def best(self):
        """The best monitored value so far (rank 0), or None."""
        return None if self._inner is None else self._inner.best

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise InvalidArgumentError("BestModelCheckpoint has no filepath: pass filepath='best.keras' (or set "
                                  "callback.filepath) before model.fit")
        if _ctx.rank() != 0:
            return
        if self._inner is None:
            import os

            os.makedirs(os.path.dirname(os.path.abspath(self.filepath)), exist_ok=True)
            self._inner = keras.callbacks.ModelCheckpoint(
                self.filepath, monitor=self.monitor, verbose=self.verbose, save_best_only=True,
                save_weights_only=self.save_weights_only, mode=self.mode, save_freq=self.save_freq)
        self._inner.set_model(self.model)
        self._inner.set_params(self.params)
        self._inner.on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._inner is not None:
            with _saving():
                self._inner.on_train_batch_end(batch, logs)

    def on_epoch_begin(self, epoch, logs=None):
        if self._inner is not None:
            self._inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._inner is not None:
            with _saving():
                self._inner.on_epoch_end(epoch, logs)


class RemoteCheckpoint(keras.callbacks.Callback):
    """Save the model to a storage URL at the end of each epoch; rank 0 writes, the others skip.

    Parameters
    ----------
    url : where to save; may contain ``{epoch}`` (1-based, like Keras's ModelCheckpoint) and any
        metric name, e.g. ``"abfss://models@acct.dfs.core.windows.net/run1/epoch-{epoch:03d}.keras"``.
        The file format follows the extension (``.keras``, ``.h5``, ``.weights.h5``).
    monitor, mode, save_best_only : as in ``keras.callbacks.ModelCheckpoint``.
    storage_options : credentials for the URL's backend (see ``sparktrain.storage``).

    Each checkpoint is uploaded atomically with its checksum, and its epoch is recorded so that
    :func:`sparktrain.keras.restore` can continue from it. No collective runs inside, so ranks
    other than 0 never wait. Put it after ``MetricAverageCallback`` to monitor averaged metrics.
    """

    def __init__(self, url: str, monitor: str = "val_loss", save_best_only: bool = False, mode: str = "auto",
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__()
        from .. import storage

        storage.check_url(url.split("{", 1)[0], storage_options)  # the scheme, before any epoch exists
        if mode not in ("auto", "min", "max"):
            raise SparkTrainError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.url = url
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.storage_options = storage_options
        self.greater_is_better = mode == "max" or (mode == "auto" and ("acc" in monitor or monitor.startswith("f")))
        self.best = None

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        if self.save_best_only:
            value = logs.get(self.monitor)
            if value is None:
                raise SparkTrainError(f"RemoteCheckpoint monitors {self.monitor!r}, but the epoch's logs have only "
                                      f"{sorted(logs)}; pass monitor= one of those")
            better = self.best is None or (value > self.best if self.greater_is_better else value < self.best)
            if not better:
                return
            self.best = value
        save_checkpoint(self.model, self.url.format(epoch=epoch + 1, **logs), epoch=epoch + 1,
                        storage_options=self.storage_options, metrics=logs)


def save_checkpoint(model, url: str, epoch: int, storage_options: Mapping[str, Any] | None = None,
                    metrics: Mapping[str, Any] | None = None) -> str | None:
    """Save ``model`` to ``url`` from rank 0 (the callable form of :class:`RemoteCheckpoint`).

    Every rank may call it; ranks other than 0 return None at once. ``epoch`` is the number of
    epochs completed, recorded for :func:`sparktrain.keras.restore`.
    """
    import os
    import tempfile

    from .. import storage

    if _ctx.rank() != 0:
        return None
    name = url.rstrip("/").rsplit("/", 1)[-1]
    suffix = next((s for s in (".weights.h5", ".keras", ".h5") if name.endswith(s)), ".keras")
    with tempfile.TemporaryDirectory(prefix="sparktrain-ckpt-") as tmp:
        local = os.path.join(tmp, "model" + suffix)
        with _saving():
            model.save_weights(local) if suffix == ".weights.h5" else model.save(local)
        metadata = {"epoch": int(epoch), "metrics": {k: float(v) for k, v in (metrics or {}).items()
                                                     if isinstance(v, (int, float))}}
        return storage.put_file(local, url, storage_options, metadata=metadata)


# Experiment tracking lives in its own module; its callbacks are Keras callbacks like these.
from .tracking import MLflowLogger, RemoteTensorBoard  # noqa: E402,F401
