"""Checkpoints from rank 0: Horovod's ``BestModelCheckpoint``, and ``RemoteCheckpoint`` /
``save_checkpoint`` to any storage URL, for the Keras of the backend they are built for (``backend.classes``)."""
from __future__ import annotations

from typing import Any, Mapping

from .. import context as _ctx
from ..errors import InvalidArgumentError, SparkTrainError


class BestModelCheckpointImpl:
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
        self._inner = None  # the Keras ModelCheckpoint that rank 0 runs

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
            self._inner = self.backend.keras.callbacks.ModelCheckpoint(
                self.filepath, monitor=self.monitor, verbose=self.verbose, save_best_only=True,
                save_weights_only=self.save_weights_only, mode=self.mode, save_freq=self.save_freq)
        self._inner.set_model(self.model)
        self._inner.set_params(self.params)
        self._inner.on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._inner is not None:
            with self.backend.saving():
                self._inner.on_train_batch_end(batch, logs)

    def on_epoch_begin(self, epoch, logs=None):
        if self._inner is not None:
            self._inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._inner is not None:
            with self.backend.saving():
                self._inner.on_epoch_end(epoch, logs)


class RemoteCheckpointImpl:
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
        save_checkpoint(self.backend, self.model, self.url.format(epoch=epoch + 1, **logs), epoch=epoch + 1,
                        storage_options=self.storage_options, metrics=logs)


def save_checkpoint(backend, model, url: str, epoch: int, storage_options: Mapping[str, Any] | None = None,
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
        with backend.saving():
            model.save_weights(local) if suffix == ".weights.h5" else model.save(local)
        metadata = {"epoch": int(epoch), "metrics": {k: float(v) for k, v in (metrics or {}).items()
                                                     if isinstance(v, (int, float))}}
        return storage.put_file(local, url, storage_options, metadata=metadata)


IMPLS = [BestModelCheckpointImpl, RemoteCheckpointImpl]
