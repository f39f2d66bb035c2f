"""Keras callbacks that track a run from rank 0: :class:`MLflowLogger` and :class:`RemoteTensorBoard`.

MLflow is imported when :class:`MLflowLogger` first runs on rank 0, never at ``import
sparktrain.keras``. Both are built for the backend's Keras (``backend.classes``), and are in
``sparktrain.keras.callbacks`` and ``sparktrain.keras.tracking``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any, Mapping

from .. import context as _ctx
from ..seam import tracking, worker_env
from ..errors import SparkTrainError


def _learning_rate(backend, optimizer) -> float | None:
    try:
        return backend.value(optimizer.learning_rate)
    except Exception:  # noqa: BLE001 - a schedule Keras cannot evaluate here
        return None


def _numeric(logs: Mapping[str, Any] | None) -> dict[str, float]:
    out = {}
    for k, v in (logs or {}).items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


class MLflowLoggerImpl:
    """Log a data-parallel ``model.fit`` to MLflow from rank 0: parameters, per-epoch metrics, the model.

    Add it on **every** rank, like ``MetricAverageCallback``: at each epoch's end the ranks average
    their metrics together (one small allreduce), and rank 0 logs the averages with the epoch
    (0-based) as the step. The other ranks never talk to MLflow.

    The run is the one the driver handed to rank 0 (an active ``mlflow.start_run()`` around
    ``sparktrain.run``, or ``MLFLOW_RUN_ID``; see docs/tracking.md). Without one, rank 0 starts a run of its own in ``MLFLOW_TRACKING_URI``'s
    experiment. Either way the run is rank 0's active MLflow run, so plain ``mlflow.log_*``
    calls in ``train_fn`` on rank 0 land in it too.

    Parameters
    ----------
    batch_size : the per-rank batch size passed to ``model.fit`` (Keras does not tell callbacks);
        logged as ``batch_size`` with ``global_batch_size = batch_size * num_proc``.
    params : more parameters to log once, e.g. ``{"dataset": "digits"}``.
    log_model : log the trained model at the end of training with ``mlflow.keras.log_model``
        under ``model_name``; load it back with ``mlflow.keras.load_model("runs:/<run_id>/model")``.
    average : average the metrics over the ranks before logging (needs the callback on every rank).
    log_model_kwargs : passed on to ``mlflow.keras.log_model`` (``signature``, ``pip_requirements``...).
        Without ``pip_requirements``, ``extra_pip_requirements`` or ``conda_env``, the model's
        requirements are this rank's keras, tensorflow and numpy, pinned to their versions (what
        MLflow would infer for a Keras 3 model, without the process it starts to infer them).

    Logged at the start of training: ``num_proc``, ``epochs``, ``steps_per_epoch``, ``optimizer``
    (its class) and ``learning_rate``, the batch sizes, and ``params``. A parameter already logged
    with another value (a resumed run that changed it) is kept, with a warning.
    """

    def __init__(self, batch_size: int | None = None, params: Mapping[str, Any] | None = None,
                 log_model: bool = True, model_name: str = "model", average: bool = True,
                 log_model_kwargs: Mapping[str, Any] | None = None):
        super().__init__()
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size <= 0):
            raise SparkTrainError(f"batch_size must be a positive int (the per-rank batch), got {batch_size!r}")
        self.batch_size = batch_size
        self.extra_params = dict(params or {})
        self.log_model = log_model
        self.model_name = model_name
        self.average = average
        self.log_model_kwargs = dict(log_model_kwargs or {})
        self.run_id: str | None = None
        self._client = None

    # -- rank 0's MLflow -----------------------------------------------------------------------------

    def _start(self) -> None:
        import mlflow

        run = mlflow.active_run()
        if run is None and os.environ.get(worker_env.RUN_ID) and not os.environ.get(tracking.IN_USE) \
                and not tracking.tracking_uri_set(mlflow):
            warnings.warn(
                "sparktrain: MLflowLogger got no tracking server from the driver (no active MLflow run and no "
                f"MLFLOW_TRACKING_URI there), so rank 0 logs to MLflow's default store in {os.getcwd()}; start a "
                "run on the driver or set MLFLOW_TRACKING_URI before sparktrain.run", RuntimeWarning, stacklevel=2)
        if run is None:
            # Resumes the driver's run when it was handed off (MLFLOW_RUN_ID); else starts one.
            handed_off = os.environ.get(tracking.HANDED_OFF_RUN) or None
            run = mlflow.start_run(run_id=handed_off)
        self.run_id = run.info.run_id
        self._client = mlflow.MlflowClient()

    def _log_params(self) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        size = _ctx.size()
        params: dict[str, Any] = {"num_proc": size}
        if self.params:
            params["epochs"] = self.params.get("epochs")
            params["steps_per_epoch"] = self.params.get("steps")
        if self.batch_size is not None:
            params["batch_size"] = self.batch_size
            params["global_batch_size"] = self.batch_size * size
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            params["optimizer"] = type(optimizer).__name__  # DistributedOptimizer keeps the class's name
            params["learning_rate"] = _learning_rate(self.backend, optimizer)
        params.update(self.extra_params)
        params = {k: v for k, v in params.items() if v is not None}
        try:
            self._client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        except MlflowException as e:
            if "INVALID_PARAMETER_VALUE" not in str(getattr(e, "error_code", "")):
                raise
            # Changing a logged parameter is refused; log the new ones one by one and keep the old values.
            logged = self._client.get_run(self.run_id).data.params
            for k, v in params.items():
                if k not in logged:
                    self._client.log_param(self.run_id, k, str(v))
                elif logged[k] != str(v):
                    warnings.warn(f"sparktrain: MLflow run {self.run_id} already has {k}={logged[k]!r}; "
                                  f"not logging {v!r}", RuntimeWarning, stacklevel=2)

    # -- callback hooks --------------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.backend.metrics_are_global:  # else nothing to average
            self.backend.ready()
        if _ctx.rank() != 0:
            return
        self._start()
        self._log_params()

    def on_epoch_end(self, epoch, logs=None):
        metrics = _numeric(logs)
        if self.average and metrics and _ctx.size() > 1 and not self.backend.metrics_are_global:
            names = sorted(metrics)
            metrics = dict(zip(names, self.backend.average_floats([metrics[k] for k in names])))
        if _ctx.rank() != 0 or not metrics:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, epoch) for k, v in metrics.items()])

    def on_train_end(self, logs=None):
        if _ctx.rank() != 0 or not self.log_model:
            return
        import mlflow

        if mlflow.active_run() is None:  # train_fn ended it meanwhile: resume, and leave it to whoever owns it
            mlflow.start_run(run_id=self.run_id)
        kwargs = {"name": self.model_name, **self.log_model_kwargs}
        if not {"pip_requirements", "extra_pip_requirements", "conda_env"} & set(kwargs):
            kwargs["pip_requirements"] = self.backend.requirements()
        with self.backend.saving():  # rank 0 alone: on JAX, outside the run's distribution
            self.backend.log_model(self.model, **kwargs)


class RemoteTensorBoardImpl:
    """Keras's TensorBoard callback on rank 0, with its event files mirrored to a storage URL as training runs.

    TensorFlow's summary writers cannot write to ``abfs://`` and friends, so rank 0 writes to a
    local directory and uploads every new or grown file to ``url`` (any fsspec URL: ``abfs://``,
    ``s3://``, ``file://``) at the end of each epoch and at the end of training. Point TensorBoard
    at ``url`` (or a copy of it) to watch the run. The other ranks do nothing, and no collective
    runs inside, so it may be added on rank 0 alone or on every rank.

    It logs the metrics it is given: put it after ``MetricAverageCallback`` to see averages over
    the ranks rather than rank 0's own.

    Parameters
    ----------
    url : where the event files go, e.g. ``"abfs://logs/run-42"``; ``train/`` and ``validation/``
        appear under it, as under Keras's ``log_dir``.
    storage_options : credentials for the URL's backend (see ``sparktrain.storage``); never logged.
    local_dir : where rank 0 writes before uploading; a temporary directory (removed at the end of
        training) when None.
    **tensorboard_kwargs : passed to ``keras.callbacks.TensorBoard`` (``histogram_freq``,
        ``write_graph``, ``update_freq``...).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, local_dir: str | None = None,
                 **tensorboard_kwargs):
        super().__init__()
        from .. import storage

        if "log_dir" in tensorboard_kwargs:
            raise SparkTrainError("RemoteTensorBoard writes under url=; pass local_dir= for the local copy, "
                                  "not log_dir=")
        storage.check_url(url, storage_options)
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.local_dir = local_dir
        self.tensorboard_kwargs = tensorboard_kwargs
        self._board = None  # the Keras TensorBoard that rank 0 runs
        self._dir: str | None = None
        self._own_dir = False
        self._synced: dict = {}

    def _on_rank0(self) -> bool:
        return _ctx.rank() == 0

    def set_model(self, model):
        super().set_model(model)
        if not self._on_rank0():
            return
        if self._board is None:
            self._own_dir = self.local_dir is None
            self._dir = tempfile.mkdtemp(prefix="sparktrain-tensorboard-") if self._own_dir else self.local_dir
            self._board = self.backend.keras.callbacks.TensorBoard(log_dir=self._dir, **self.tensorboard_kwargs)
        self._board.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if self._board is not None:
            self._board.set_params(params)

    def sync(self) -> None:
        """Upload what changed since the last sync (rank 0; other ranks return at once)."""
        if self._board is None or self._dir is None:
            return
        from .. import storage

        for writer in list(getattr(self._board, "_writers", {}).values()):
            writer.flush()
        self._synced = storage.sync_dir(self._dir, self.url, self.storage_options, self._synced)

    def _delegate(self, hook: str, *args) -> None:
        if self._board is not None:
            getattr(self._board, hook)(*args)

    def on_train_begin(self, logs=None):
        self._delegate("on_train_begin", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._delegate("on_epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._delegate("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._delegate("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self._delegate("on_test_begin", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._delegate("on_test_batch_begin", batch, logs)

    def on_test_end(self, logs=None):
        self._delegate("on_test_end", logs)

    def on_epoch_end(self, epoch, logs=None):
        self._delegate("on_epoch_end", epoch, logs)
        self.sync()

    def on_train_end(self, logs=None):
        if self._board is None:
            return
        self._board.on_train_end(logs)  # closes the writers: the files are complete
        self.sync()
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._board, self._dir, self._synced = None, None, {}


IMPLS = [MLflowLoggerImpl, RemoteTensorBoardImpl]
