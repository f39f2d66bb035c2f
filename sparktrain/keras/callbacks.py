"""Keras 3 callbacks with Horovod's names: broadcast, metric averaging, learning-rate warm-up."""
from __future__ import annotations

from typing import Any, Mapping

import keras

from .. import tensorflow as _tfc
from ..errors import SparkTrainError


def check_equal_steps(steps) -> None:
    """Fail fast, on every rank, when ranks would run different numbers of steps per epoch.

    A rank that runs out of batches early would leave the others waiting in a gradient
    collective until it times out. sparktrain raises instead of equalizing: silently dropping or
    repeating a rank's batches changes what is trained on.
    """
    import tensorflow as tf

    known = -1 if steps is None else int(steps)
    everyone = [int(s) for s in _tfc.allgather(tf.constant([known], tf.int64)).numpy()]
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
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._done_first_batch = False

    def on_train_begin(self, logs=None):
        _tfc.init()
        check_equal_steps(self.params.get("steps") if self.params else None)
        _tfc.broadcast_variables(self.model.variables, self.root_rank)
        self._done_first_batch = False

    def on_train_batch_end(self, batch, logs=None):
        if self._done_first_batch:
            return
        self._done_first_batch = True
        _tfc.broadcast_variables(list(self.model.variables) + list(self.model.optimizer.variables), self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics with their average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping), so they see the
    averaged values. Every rank must report the same metric names.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        import tensorflow as tf

        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype"))
        if not names:
            return
        values = _tfc.allreduce(tf.constant([float(logs[k]) for k in names], tf.float64), op=_tfc.Average)
        for k, v in zip(names, values.numpy().tolist()):
            logs[k] = v


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` up to ``initial_lr`` over the first epochs.

    Large learning rates scaled by the number of ranks can diverge at the start; Horovod's
    warm-up (Goyal et al.) raises the rate linearly per batch over ``warmup_epochs``.

    Parameters
    ----------
    initial_lr : the learning rate after warm-up (usually the single-process rate times size()).
    warmup_epochs : how many epochs the ramp lasts.
    steps_per_epoch : batches per epoch; taken from ``model.fit`` when it knows it.
    verbose : print the rate when warm-up ends (rank 0 only).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        super().__init__()
        if not initial_lr > 0:
            raise SparkTrainError(f"initial_lr must be positive, got {initial_lr!r}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch >= self.warmup_epochs:
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise SparkTrainError("LearningRateWarmupCallback needs steps_per_epoch when model.fit does not know it")
        progress = (self._epoch + batch / steps) / self.warmup_epochs
        size = _tfc.size()
        self.model.optimizer.learning_rate.assign(self.initial_lr / size * (progress * (size - 1) + 1))

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate.assign(self.initial_lr)
            if self.verbose and _tfc.rank() == 0:
                print(f"Epoch {epoch + 1}: finished learning-rate warm-up to {self.initial_lr:g}.")


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

    if _tfc.rank() != 0:
        return None
    name = url.rstrip("/").rsplit("/", 1)[-1]
    suffix = next((s for s in (".weights.h5", ".keras", ".h5") if name.endswith(s)), ".keras")
    with tempfile.TemporaryDirectory(prefix="sparktrain-ckpt-") as tmp:
        local = os.path.join(tmp, "model" + suffix)
        if suffix == ".weights.h5":
            model.save_weights(local)
        else:
            model.save(local)
        metadata = {"epoch": int(epoch), "metrics": {k: float(v) for k, v in (metrics or {}).items()
                                                     if isinstance(v, (int, float))}}
        return storage.put_file(local, url, storage_options, metadata=metadata)


# Experiment tracking lives in its own module; its callbacks are Keras callbacks like these.
from .tracking import MLflowLogger, RemoteTensorBoard  # noqa: E402,F401
