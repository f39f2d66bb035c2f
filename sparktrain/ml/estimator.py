"""``KerasEstimator``: a Spark ML Estimator whose ``fit(df)`` is one ``sparktrain.run(..., data=df)``.

Everything a fit could trip on is checked here on the driver, before any Spark job: the model, the
columns and their types, the model's outputs against ``label_cols``, and the store's scheme.
"""
from __future__ import annotations

import uuid
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from ..errors import InvalidArgumentError, UnsupportedError
from . import columns
from .params import ESTIMATOR, set_defaults, with_params
from .persistence import StageReader, StageWriter
from .training import TrainSpec, keras_bytes, model_url_of

#: Horovod's KerasEstimator parameters that have no place here, and why.
NOT_SUPPORTED = {
    "backend": "the Spark cluster is the backend; num_proc says how many ranks",
    "transformation_fn": "rows reach the ranks as the DataFrame's columns; transform them in Spark first",
    "train_reader_num_workers": "there is no petastorm reader: each rank memory-maps its spooled shard",
    "val_reader_num_workers": "there is no petastorm reader: each rank memory-maps its spooled shard",
    "reader_pool_type": "there is no petastorm reader: each rank memory-maps its spooled shard",
    "inmemory_cache_all": "the spooled shard is memory-mapped, so the OS already caches it",
    "shuffle_buffer_size": "each epoch shuffles the rank's whole shard (shuffle=True)",
    "partitions_per_process": "the feed deals rows, not partitions, evenly over the ranks",
    "train_steps_per_epoch": "every rank runs the same steps per epoch, computed from its shard",
    "validation_steps_per_epoch": "every rank runs the same steps per epoch, computed from its shard",
    "label_shapes": "reshape the labels in the model's loss, or in Spark",
    "continuous_columns": "assemble the features into one column (VectorAssembler)",
    "categorical_columns": "encode categories in Spark first (StringIndexer, OneHotEncoder)",
    "checkpoint_callback": "each epoch is checkpointed to the store; pass more callbacks with callbacks=",
}


@with_params(ESTIMATOR)
class KerasEstimator(Estimator, MLReadable, MLWritable):
    """Train a Keras 3 model data-parallel on a DataFrame: ``KerasEstimator(...).fit(df)`` gives a
    :class:`~sparktrain.ml.KerasModel` whose ``transform`` scores DataFrames.

    The parameters are Horovod's ``horovod.spark.keras.KerasEstimator``'s where they mean the same
    (see docs/estimator.md), except that ``store`` is an fsspec URL with ``storage_options``.
    """

    @keyword_only
    def __init__(self, **kwargs: Any):
        super().__init__()
        set_defaults(self)
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs: Any) -> "KerasEstimator":
        for name in kwargs:
            if name in NOT_SUPPORTED:
                raise UnsupportedError(f"KerasEstimator does not take Horovod's {name}=: {NOT_SUPPORTED[name]}")
            if name not in self._specs:
                raise InvalidArgumentError(f"KerasEstimator has no parameter {name!r}; its parameters: "
                                           f"{sorted(self._specs)}")
        return self._set(**self._input_kwargs)

    def write(self) -> StageWriter:
        return StageWriter(self)

    @classmethod
    def read(cls) -> StageReader:
        return StageReader(cls)

    # -- fit --------------------------------------------------------------------------------------------

    def _fit(self, dataset):
        import sparktrain

        from .model import KerasModel

        spec, data, run_url = self._prepare(dataset)
        history = sparktrain.run(
            _train_on_rank, args=(spec,), num_proc=self.getNumProc(), data=data, verbose=self.getVerbose(),
            env=self.getEnv(), storage_options=self.getStorageOptions(), max_attempts=self.getMaxAttempts())
        model = KerasModel(model_url=model_url_of(run_url), history=history, run_id=run_url.rsplit("/", 1)[-1],
                           feature_cols=spec.feature_cols, label_cols=spec.label_cols,
                           output_cols=self.getOutputCols() or [f"{c}__output" for c in spec.label_cols],
                           custom_objects=spec.custom_objects, storage_options=spec.storage_options)
        return model

    def _prepare(self, df):
        """Checks every parameter against ``df`` and the model; returns the ranks' spec, the fed
        DataFrames and the run's URL in the store."""
        from .. import storage, tracking

        keras_model = _check_model(self.getModel())
        store = self.getStore()
        if not store:
            raise InvalidArgumentError("store is not set: pass store='abfss://container@account.dfs.core.windows.net/"
                                       "models' (any fsspec URL; file:///path for a shared disk)")
        options = self.getStorageOptions()
        storage.check_url(store, options)
        if self.getOptimizer() is None or self.getLoss() is None:
            raise InvalidArgumentError("optimizer and loss must both be set, e.g. optimizer=keras.optimizers.Adam(1e-3), "
                                       "loss='sparse_categorical_crossentropy'")
        feature_cols = list(self.getFeatureCols() or [])
        label_cols = list(self.getLabelCols() or [])
        inputs, outputs = len(keras_model.inputs), len(keras_model.outputs)
        columns.check_features(df.schema, feature_cols, inputs)
        if not label_cols:
            raise InvalidArgumentError("label_cols is not set: name the label column(s), one per model output")
        columns.check(df.schema, label_cols, "label columns", "label_cols")
        if len(label_cols) != outputs:
            raise InvalidArgumentError(
                f"label_cols {label_cols} name {len(label_cols)} label(s), and the model has {outputs} output(s): "
                "name one label column per output, in the order of model.outputs")
        weight = self.getSampleWeightCol()
        if weight is not None and columns.check(df.schema, [weight], "sample weights", "sample_weight_col") != ["scalar"]:
            raise InvalidArgumentError(f"sample_weight_col {weight!r} must be a numeric scalar column")
        out_cols = self.getOutputCols()
        if out_cols is not None and len(out_cols) != len(label_cols):
            raise InvalidArgumentError(f"output_cols {out_cols} must name one column per label in {label_cols}")
        train_df, val_df = _split(df, self.getValidation(), self.getRandomSeed())
        needed = list(dict.fromkeys(feature_cols + label_cols + ([weight] if weight else [])))
        data = {"train": train_df.select(*needed)}
        if val_df is not None:
            data["val"] = val_df.select(*needed)
        run_url = f"{store.rstrip('/')}/{self.getRunId() or 'keras_' + uuid.uuid4().hex[:12]}"
        spec = TrainSpec(
            model=keras_bytes(keras_model), input_names=[t.name for t in keras_model.inputs],
            output_names=list(getattr(keras_model, "output_names", None) or [t.name for t in keras_model.outputs]),
            optimizer=self.getOptimizer(), loss=self.getLoss(), loss_weights=self.getLossWeights(),
            metrics=self.getMetrics(), callbacks=list(self.getCallbacks() or []),
            custom_objects=self.getCustomObjects(), compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(), feature_cols=feature_cols, label_cols=label_cols,
            sample_weight_col=weight, validation=val_df is not None, batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(), epochs=self.getEpochs(),
            verbose=self.getVerbose(), random_seed=self.getRandomSeed(), shuffle=self.getShuffle(), run_url=run_url,
            storage_options=options, mlflow=bool(tracking.mlflow_handoff(user_env=self.getEnv())),
            registered_model_name=self.getRegisteredModelName())
        return spec, data, run_url


def _train_on_rank(spec):
    from .training import train

    return train(spec)


def _check_model(model):
    try:
        import keras
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise InvalidArgumentError("KerasEstimator needs Keras 3 on the driver: pip install keras") from e
    if model is None:
        raise InvalidArgumentError("model is not set: pass model=keras.Sequential([...]) (built, not compiled)")
    if not isinstance(model, keras.Model):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        hint = (" It is a tf.keras (Keras 2) model: build it with Keras 3's `import keras`."
                if kind.startswith(("tf_keras", "tensorflow.python.keras", "keras.src.engine")) else "")
        raise InvalidArgumentError(f"model must be a Keras 3 keras.Model, got {kind}.{hint}")
    try:
        model.inputs, model.outputs
    except (AttributeError, ValueError) as e:
        raise InvalidArgumentError(f"model {model.name!r} is not built, so its inputs are unknown: give it an "
                                   "input shape (keras.Input(shape=...)) before fit") from e
    if not model.inputs:
        raise InvalidArgumentError(f"model {model.name!r} is not built: give it keras.Input(shape=...)")
    return model


def _split(df, validation, seed):
    if validation is None:
        return df, None
    if isinstance(validation, str):
        from pyspark.sql import functions as F

        columns.check_boolean(df.schema, validation, "validation")
        return df.filter(~F.col(validation)), df.filter(F.col(validation))
    if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0 < validation < 1:
        raise InvalidArgumentError(f"validation={validation!r} must be a fraction between 0 and 1 (e.g. 0.2) or the "
                                   "name of a boolean column")
    train_df, val_df = df.randomSplit([1 - validation, validation], seed=seed)
    return train_df, val_df
