"""What every rank runs for ``KerasEstimator.fit``: ``model.fit`` on the rank's shard of the fed
DataFrames, with the Keras the model was built with (Keras 3, or tf_keras where the estimator set
``TF_USE_LEGACY_KERAS=1`` for a Keras 2 model), and rank 0's writes to the store.

A run's place in the store is ``<store>/<run_id>/`` (a Store's: ``<prefix>/runs/<run_id>/``):

- ``checkpoints/epoch-NNNN.keras``: the model after each epoch, with its optimizer state and the
  epoch's metrics (averaged over the ranks) in its manifest, each committed atomically by rank 0;
- ``model.keras`` (a Store's ``checkpoint_filename``): the trained model, written by rank 0 once
  the last epoch is done: the model that rank 0's checkpoint callback kept, where it kept one.

Each rank casts its features to the dtypes of the model's inputs and its labels to those of its
outputs (dtypes.py), reshapes them to the model's inputs and their shapes (shapes.py), all decided
on the driver and done once, in the input pipeline; and it runs ``train_steps_per_epoch`` batches
per epoch where it is set.

A run that finds checkpoints under its ``run_id`` (a retried attempt, or a fit given the
``run_id`` of an unfinished one) resumes after the latest, and its history starts with the epochs
already done. A fit given a ``run_id`` is a named run of ``sparktrain.run``: on TensorFlow its
ranks also run ``BackupAndRestore`` into the run's home (``<elastic_url>/<run_id>/backup/``), which
every rank reads at ``fit``'s start. Keras and sparktrain.keras are imported here only inside the rank.
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
    keras_line: str = "keras"  # kerasline.KERAS_3 or TF_KERAS: the Keras the ranks train with
    feature_dtypes: list | None = None  # per model input: the dtype its column(s) are cast to, or None
    label_dtypes: list | None = None  # per label column, likewise
    named: bool = False  # a run_id: a named run, backed up at epoch ends into its home (on TensorFlow)


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

    if spec.mp_start_method:
        import multiprocessing

        multiprocessing.set_start_method(spec.mp_start_method, force=True)
    _check_served(spec.keras_line)
    import sparktrain.keras as hvd

    from ..keras.front import backend
    from .portable import load_bytes, unpack

    keras = backend.keras  # the model's: _check_served refused any other
    hvd.init()
    jax = backend.keras_distribution  # Keras 3 on JAX: keras.distribution reduces the gradients
    if jax:
        keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed)
    prefix = checkpoints_of(spec.run_url)
    model, initial_epoch = hvd.restore(prefix, spec.storage_options, custom_objects=spec.custom_objects)
    if model is None:
        model = load_bytes(spec.model, spec.custom_objects, spec.keras_line)
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
        if spec.named and not jax:  # the run's home, <elastic_url>/<run_id>/backup/: a new job resumes from it
            callbacks.append(hvd.callbacks.BackupAndRestore(storage_options=spec.storage_options))
        model.fit(ds, validation_data=val, epochs=spec.epochs, initial_epoch=initial_epoch, shuffle=False,
                  verbose=spec.verbose if hvd.rank() == 0 else 0, callbacks=callbacks)
        if hvd.rank() != 0:
            return {}
        if kept_file is not None and os.path.exists(kept_file):
            # What the checkpoint callback kept (its best epoch, say), loaded by rank 0 alone.
            model = backend.with_weights(model, kept_file, spec.custom_objects)
        hvd.callbacks.save_checkpoint(model, spec.model_url, epoch=spec.epochs, storage_options=spec.storage_options)
    return history_of(spec.run_url, spec.storage_options, spec.epochs)


def _check_served(line: str) -> None:
    """Refuse to train where this process's ``tf.keras`` is not the model's Keras (an environment
    that overrode the estimator's ``TF_USE_LEGACY_KERAS``)."""
    from .. import kerasline

    kerasline.check_served(line, f"leave {kerasline.LEGACY_ENV} to the estimator, which sets it from the model")


def _datasets(spec: TrainSpec):
    """The rank's training and validation datasets: cast and reshaped to the model's inputs (and
    the labels to their dtypes and shapes), and cut to the steps per epoch asked for."""
    import sparktrain.data as data

    features = spec.feature_cols[0] if len(spec.feature_cols) == 1 else list(spec.feature_cols)
    if len(spec.input_names) > 1:  # one column per input, by the inputs' names
        features = dict(zip(spec.input_names, spec.feature_cols))
    label = spec.label_cols[0] if len(spec.label_cols) == 1 else dict(zip(spec.output_names, spec.label_cols))
    ds = data.dataset(features, label, batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.random_seed,
                      sample_weight=spec.sample_weight_col)
    ds = _fitted(ds, spec)
    if spec.train_steps:
        # Each epoch takes the next batches of a new pass over the shard: with shuffle, a new order.
        ds = ds.repeat().take(spec.train_steps)
    if not spec.validation:
        return ds, None
    val = data.dataset(features, label, batch_size=spec.val_batch_size, shuffle=False, name="val",
                       sample_weight=spec.sample_weight_col)
    val = _fitted(val, spec)
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
            return (_part(x, spec.input_names, spec.feature_shapes, _dtypes(spec.feature_dtypes, spec.input_names)),
                    _part(y, spec.output_names, spec.label_shapes, _dtypes(spec.label_dtypes, spec.output_names)),
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


def _dtypes(dtypes, names) -> list:
    return list(dtypes) if dtypes is not None else [None] * len(names)


def _part(value, names, shapes, dtypes):
    """A batch's features or labels (an array, or a dict by input name) cast to ``dtypes`` and
    reshaped to ``shapes``."""
    if isinstance(value, dict):
        return {k: _part(v, [k], [shapes[names.index(k)]], [dtypes[names.index(k)]]) for k, v in value.items()}
    value = value if dtypes[0] is None else value.astype(dtypes[0])
    return value if shapes[0] is None else value.reshape((-1, *shapes[0]))


def _fitted(ds, spec: TrainSpec):
    """``ds`` with each feature cast to its model input's dtype and reshaped to its shape, and each
    label cast to its output's dtype and reshaped to its shape: one map, in the input pipeline."""
    feature_dtypes = _dtypes(spec.feature_dtypes, spec.input_names)
    label_dtypes = _dtypes(spec.label_dtypes, spec.output_names)
    if not any(s is not None for s in [*spec.feature_shapes, *spec.label_shapes, *feature_dtypes, *label_dtypes]):
        return ds
    import tensorflow as tf

    def one(tensor, shape, dtype):
        tensor = tensor if dtype is None else tf.cast(tensor, dtype)
        return tensor if shape is None else tf.reshape(tensor, (-1, *shape))

    def part(value, names, shapes, dtypes):
        if isinstance(value, dict):
            return {k: one(v, shapes[names.index(k)], dtypes[names.index(k)]) for k, v in value.items()}
        return one(value, shapes[0], dtypes[0])

    def fit(x, y, *weight):
        return (part(x, spec.input_names, spec.feature_shapes, feature_dtypes),
                part(y, spec.output_names, spec.label_shapes, label_dtypes), *weight)

    return ds.map(fit)


def _checkpoint_file(callback, tmp: str | None) -> str | None:
    """Point rank 0's checkpoint callback at a file of its own; None on the other ranks or without one."""
    if callback is None or tmp is None:
        return None
    name = "checkpoint.weights.h5" if getattr(callback, "save_weights_only", False) else "checkpoint.keras"
    callback.filepath = os.path.join(tmp, name)
    return callback.filepath
