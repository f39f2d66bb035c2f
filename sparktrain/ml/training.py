"""What every rank runs for ``KerasEstimator.fit``: Keras 3's ``fit`` on the rank's shard of the fed
DataFrames, and rank 0's writes to the store.

A run's place in the store is ``<store>/<run_id>/``:

- ``checkpoints/epoch-NNNN.keras``: the model after each epoch, with its optimizer state and the
  epoch's metrics (averaged over the ranks) in its manifest, each committed atomically by rank 0;
- ``model.keras``: the trained model, written by rank 0 once the last epoch is done.

A run that finds checkpoints under its ``run_id`` (a retried attempt, or a fit given the
``run_id`` of an unfinished one) resumes after the latest, and its history starts with the epochs
already done. Keras and sparktrain.keras are imported here only inside the rank.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class TrainSpec(NamedTuple):
    """Everything the ranks need; pickled with the run's payload. The model travels as the bytes
    of its ``.keras`` file, loaded in the rank with the custom objects."""
    model: bytes
    input_names: list
    output_names: list
    optimizer: Any
    loss: Any
    loss_weights: Any
    metrics: Any
    callbacks: list
    custom_objects: dict | None
    compression: Any
    backward_passes_per_step: int
    feature_cols: list
    label_cols: list
    sample_weight_col: str | None
    validation: bool
    batch_size: int
    val_batch_size: int
    epochs: int
    verbose: int
    random_seed: int | None
    shuffle: bool
    run_url: str
    storage_options: dict | None
    mlflow: bool
    registered_model_name: str | None


def checkpoints_of(run_url: str) -> str:
    return f"{run_url}/checkpoints"


def model_url_of(run_url: str) -> str:
    return f"{run_url}/model.keras"


def history_of(run_url: str, storage_options=None, epochs: int | None = None) -> dict[str, list[float]]:
    """The per-epoch metrics of the epochs committed under ``run_url`` (the first ``epochs`` of them)."""
    from .. import storage

    rows = []
    for url in storage.list_checkpoints(checkpoints_of(run_url), storage_options):
        rows.append(storage.read_manifest(url, storage_options).get("metadata", {}).get("metrics", {}))
    rows = rows[:epochs] if epochs is not None else rows
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in names}


def train(spec: TrainSpec) -> dict[str, list[float]]:
    """One rank's part of ``fit``; rank 0 returns the whole history."""
    import keras

    import sparktrain.data as data
    import sparktrain.keras as hvd

    hvd.init()
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed)
    prefix = checkpoints_of(spec.run_url)
    model, initial_epoch = hvd.restore(prefix, spec.storage_options, custom_objects=spec.custom_objects)
    if model is None:
        model = _load_bytes(spec.model, spec.custom_objects)
        optimizer = hvd.DistributedOptimizer(spec.optimizer, compression=spec.compression or hvd.Compression.none,
                                             backward_passes_per_step=spec.backward_passes_per_step)
        model.compile(optimizer=optimizer, loss=spec.loss, loss_weights=spec.loss_weights, metrics=spec.metrics)
    elif hvd.rank() == 0:
        print(f"resuming {spec.run_url} after epoch {initial_epoch}", flush=True)
    features = spec.feature_cols[0] if len(spec.feature_cols) == 1 else list(spec.feature_cols)
    if len(spec.input_names) > 1:  # one column per input, by the inputs' names
        features = dict(zip(spec.input_names, spec.feature_cols))
    label = spec.label_cols[0] if len(spec.label_cols) == 1 else dict(zip(spec.output_names, spec.label_cols))
    ds = data.dataset(features, label, batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.random_seed,
                      sample_weight=spec.sample_weight_col)
    val = None
    if spec.validation:
        val = data.dataset(features, label, batch_size=spec.val_batch_size, shuffle=False, name="val",
                           sample_weight=spec.sample_weight_col)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 *spec.callbacks]
    if spec.mlflow:
        kwargs = {"registered_model_name": spec.registered_model_name} if spec.registered_model_name else {}
        callbacks.append(hvd.callbacks.MLflowLogger(batch_size=spec.batch_size, log_model=True,
                                                    log_model_kwargs=kwargs, average=False))
    callbacks.append(hvd.callbacks.RemoteCheckpoint(prefix + "/epoch-{epoch:04d}.keras",
                                                    storage_options=spec.storage_options))
    model.fit(ds, validation_data=val, epochs=spec.epochs, initial_epoch=initial_epoch, shuffle=False,
              verbose=spec.verbose if hvd.rank() == 0 else 0, callbacks=callbacks)
    if hvd.rank() != 0:
        return {}
    hvd.callbacks.save_checkpoint(model, model_url_of(spec.run_url), epoch=spec.epochs,
                                  storage_options=spec.storage_options)
    return history_of(spec.run_url, spec.storage_options, spec.epochs)


def keras_bytes(model) -> bytes:
    """``model`` as the bytes of a ``.keras`` file."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def _load_bytes(data: bytes, custom_objects):
    import os
    import tempfile

    import keras

    with tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=False)
