"""What every rank runs for ``KerasEstimator.fit``: Keras 3's ``fit`` on the rank's shard of the fed
DataFrames, and rank 0's writes to the store.

A run's place in the store is ``<store>/<run_id>/`` (a Store's: ``<prefix>/runs/<run_id>/``):

- ``checkpoints/epoch-NNNN.keras``: the model after each epoch, with its optimizer state and the
  epoch's metrics (averaged over the ranks) in its manifest, each committed atomically by rank 0;
- ``model.keras`` (a Store's ``checkpoint_filename``): the trained model, written by rank 0 once
  the last epoch is done: the model that rank 0's checkpoint callback kept, where it kept one.

Each rank reshapes its features to the model's inputs and its labels to their shapes (decided on
the driver, shapes.py), and runs ``train_steps_per_epoch`` batches per epoch where it is set.

A run that finds checkpoints under its ``run_id`` (a retried attempt, or a fit given the
``run_id`` of an unfinished one) resumes after the latest, and its history starts with the epochs
already done. Keras and sparktrain.keras are imported here only inside the rank.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple


class TrainSpec(NamedTuple):
    """Everything the ranks need; pickled with the run's payload. The model travels as the bytes
    of its ``.keras`` file, loaded in the rank with the custom objects; the optimizer, loss and
    metrics as portable.pack made them."""
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
    model_url: str
    storage_options: dict | None
    mlflow: bool
    registered_model_name: str | None
    feature_shapes: list  # per model input: the shape (batch left out) its column is reshaped to, or None
    label_shapes: list  # per label column, likewise
    train_steps: int | None  # batches per epoch on every rank; None: the whole shard
    val_steps: int | None
    checkpoint_callback: Any  # rank 0's; its file becomes the trained model
    mp_start_method: str | None


def checkpoints_of(run_url: str) -> str:
    return f"{run_url}/checkpoints"


def model_url_of(run_url: str, name: str = "model.keras") -> str:
    return f"{run_url}/{name}"


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
    import contextlib
    import tempfile

    import keras

    import sparktrain.keras as hvd

    from .portable import load_bytes, unpack

    if spec.mp_start_method:
        import multiprocessing

        multiprocessing.set_start_method(spec.mp_start_method, force=True)
    from ..keras.on_jax import on_jax, saving

    hvd.init()
    jax = on_jax()  # Keras 3 on JAX: keras.distribution reduces the gradients, not DistributedOptimizer
    if jax:
        keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed)
    prefix = checkpoints_of(spec.run_url)
    model, initial_epoch = hvd.restore(prefix, spec.storage_options, custom_objects=spec.custom_objects)
    if model is None:
        model = load_bytes(spec.model, spec.custom_objects)
        optimizer = unpack(spec.optimizer, spec.custom_objects)
        if not jax:
            optimizer = hvd.DistributedOptimizer(optimizer, compression=spec.compression or hvd.Compression.none,
                                                 backward_passes_per_step=spec.backward_passes_per_step)
        model.compile(optimizer=optimizer, loss=unpack(spec.loss, spec.custom_objects), loss_weights=spec.loss_weights,
                      metrics=unpack(spec.metrics, spec.custom_objects))
    elif hvd.rank() == 0:
        print(f"resuming {spec.run_url} after epoch {initial_epoch}", flush=True)
    ds, val = _batches(spec) if jax else _datasets(spec)
    kept = tempfile.TemporaryDirectory(prefix="sparktrain-kept-") if hvd.rank() == 0 else contextlib.nullcontext()
    with kept as tmp:
        callbacks = [] if jax else [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.MetricAverageCallback()]
        callbacks += spec.callbacks
        if spec.mlflow:
            kwargs = {"registered_model_name": spec.registered_model_name} if spec.registered_model_name else {}
            callbacks.append(hvd.callbacks.MLflowLogger(batch_size=spec.batch_size, log_model=True,
                                                        log_model_kwargs=kwargs, average=False))
        kept_file = _checkpoint_file(spec.checkpoint_callback, tmp)
        if kept_file is not None:  # rank 0 alone runs it, as Horovod's estimator does
            callbacks.append(spec.checkpoint_callback)
        callbacks.append(hvd.callbacks.RemoteCheckpoint(prefix + "/epoch-{epoch:04d}.keras",
                                                        storage_options=spec.storage_options))
        model.fit(ds, validation_data=val, epochs=spec.epochs, initial_epoch=initial_epoch, shuffle=False,
                  verbose=spec.verbose if hvd.rank() == 0 else 0, callbacks=callbacks)
        if hvd.rank() != 0:
            return {}
        if kept_file is not None and os.path.exists(kept_file):
            with saving():  # rank 0 alone: on JAX, outside the run's distribution
                model.load_weights(kept_file)  # what the checkpoint callback kept (its best epoch, say)
        hvd.callbacks.save_checkpoint(model, spec.model_url, epoch=spec.epochs, storage_options=spec.storage_options)
    return history_of(spec.run_url, spec.storage_options, spec.epochs)


def _datasets(spec: TrainSpec):
    """The rank's training and validation datasets: reshaped to the model's inputs (and the labels
    to their shapes), and cut to the steps per epoch asked for."""
    import sparktrain.data as data

    features = spec.feature_cols[0] if len(spec.feature_cols) == 1 else list(spec.feature_cols)
    if len(spec.input_names) > 1:  # one column per input, by the inputs' names
        features = dict(zip(spec.input_names, spec.feature_cols))
    label = spec.label_cols[0] if len(spec.label_cols) == 1 else dict(zip(spec.output_names, spec.label_cols))
    ds = data.dataset(features, label, batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.random_seed,
                      sample_weight=spec.sample_weight_col)
    ds = _reshaped(ds, spec)
    if spec.train_steps:
        # Each epoch takes the next batches of a new pass over the shard: with shuffle, a new order.
        ds = ds.repeat().take(spec.train_steps)
    if not spec.validation:
        return ds, None
    val = data.dataset(features, label, batch_size=spec.val_batch_size, shuffle=False, name="val",
                       sample_weight=spec.sample_weight_col)
    val = _reshaped(val, spec)
    if spec.val_steps:
        val = val.repeat().take(spec.val_steps)
    return ds, val


def _batches(spec: TrainSpec):
    """On JAX: the rank's training and validation batches as ``keras.utils.PyDataset`` (each rank's
    part of every global batch), reshaped and cut as :func:`_datasets` does, without TensorFlow."""
    import keras

    import sparktrain.data as data

    features = spec.feature_cols[0] if len(spec.feature_cols) == 1 else list(spec.feature_cols)
    if len(spec.input_names) > 1:
        features = dict(zip(spec.input_names, spec.feature_cols))
    label = spec.label_cols[0] if len(spec.label_cols) == 1 else dict(zip(spec.output_names, spec.label_cols))

    class Cut(keras.utils.PyDataset):
        """``inner``'s batches reshaped, ``steps`` of them per epoch (the next ones of a new pass)."""

        def __init__(self, inner, steps):
            super().__init__()
            self.inner, self.steps = inner, steps or len(inner)

        def __len__(self):
            return self.steps

        def __getitem__(self, i):
            x, y, *weight = self.inner[i % len(self.inner)]
            return (_part(x, spec.input_names, spec.feature_shapes), _part(y, spec.output_names, spec.label_shapes),
                    *weight)

        def on_epoch_end(self):
            self.inner.on_epoch_end()

    ds = data.pydataset(features, label, batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.random_seed,
                        sample_weight=spec.sample_weight_col)
    if not spec.validation:
        return Cut(ds, spec.train_steps), None
    val = data.pydataset(features, label, batch_size=spec.val_batch_size, shuffle=False, name="val",
                         sample_weight=spec.sample_weight_col)
    return Cut(ds, spec.train_steps), Cut(val, spec.val_steps)


def _part(value, names, shapes):
    """A batch's features or labels (an array, or a dict by input name) reshaped to ``shapes``."""
    if isinstance(value, dict):
        return {k: _part(v, [k], [shapes[names.index(k)]]) for k, v in value.items()}
    return value if shapes[0] is None else value.reshape((-1, *shapes[0]))


def _reshaped(ds, spec: TrainSpec):
    """``ds`` with each feature reshaped to its model input's shape and each label to its shape."""
    if not any(s is not None for s in [*spec.feature_shapes, *spec.label_shapes]):
        return ds
    import tensorflow as tf

    def one(tensor, shape):
        return tensor if shape is None else tf.reshape(tensor, (-1, *shape))

    def part(value, names, shapes):
        if isinstance(value, dict):
            return {k: one(v, shapes[names.index(k)]) for k, v in value.items()}
        return one(value, shapes[0])

    def reshape(x, y, *weight):
        return (part(x, spec.input_names, spec.feature_shapes), part(y, spec.output_names, spec.label_shapes),
                *weight)

    return ds.map(reshape)


def _checkpoint_file(callback, tmp: str | None) -> str | None:
    """Point rank 0's checkpoint callback at a file of its own; None on the other ranks or without one."""
    if callback is None or tmp is None:
        return None
    name = "checkpoint.weights.h5" if getattr(callback, "save_weights_only", False) else "checkpoint.keras"
    callback.filepath = os.path.join(tmp, name)
    return callback.filepath
