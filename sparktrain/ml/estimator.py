"""``KerasEstimator``: a Spark ML Estimator whose ``fit(df)`` is one ``sparktrain.run(..., data=df)``.

Everything a fit could trip on is checked here on the driver, before the run: the model, the
columns and their types, the columns' lengths against the model's inputs and outputs, the store,
the backend and Horovod's other parameters (see params.py for which are honoured, which are
performance hints without effect here, and which are refused).
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from ..errors import InvalidArgumentError, UnsupportedError
from . import columns, dtypes, lines, shapes
from .backend import SparkBackend
from .params import ESTIMATOR, NO_EFFECT, NOT_SUPPORTED, set_defaults, with_params
from .persistence import StageReader, StageWriter
from .portable import keras_bytes, pack
from .store import Store
from .training import TrainSpec, model_url_of

__all__ = ["KerasEstimator", "NOT_SUPPORTED", "NO_EFFECT"]

log = logging.getLogger("sparktrain")

#: Python multiprocessing's start methods (Horovod's mp_start_method).
START_METHODS = ("fork", "spawn", "forkserver")


@with_params(ESTIMATOR)
class KerasEstimator(Estimator, MLReadable, MLWritable):
    """Train a Keras model data-parallel on a DataFrame: ``KerasEstimator(...).fit(df)`` gives a
    :class:`~sparktrain.ml.KerasModel` whose ``transform`` scores DataFrames.

    The model is Keras 3 (``import keras``) or tf_keras (Keras 2: ``tf.keras`` under
    ``TF_USE_LEGACY_KERAS=1``), and the ranks train and the model scores with the Keras it was
    built with; the optimizer, loss, metrics and callbacks must be of the same Keras. Features and
    labels reach the model in the dtypes of its inputs and outputs (a double label column reaches a
    float32 output as float32).

    The parameters are Horovod's ``horovod.spark.keras.KerasEstimator``'s (docs/estimator.md says
    which are honoured, which have no effect here and which are refused); ``store`` is a
    :class:`~sparktrain.ml.Store` (``Store.create(url)``) or an fsspec URL with ``storage_options``.
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

        spec, data, launch = self._prepare(dataset)
        run_id = self.getRunId() if spec.named else None
        value = sparktrain.run(_train_on_rank, args=(spec,), data=data, run_id=run_id, **launch)
        history, model_url = _fit_result(value, run_id)
        return KerasModel(model_url=model_url, history=history, run_id=spec.run_url.rsplit("/", 1)[-1],
                          feature_cols=spec.feature_cols, label_cols=spec.label_cols,
                          output_cols=self.getOutputCols() or [f"{c}__output" for c in spec.label_cols],
                          custom_objects=spec.custom_objects, storage_options=spec.storage_options,
                          keras_line=spec.keras_line)

    def _prepare(self, df):
        """Checks every parameter against ``df`` and the model; returns the ranks' spec, the fed
        DataFrames and ``sparktrain.run``'s keywords."""
        from ..seam import tracking

        keras_model, line = lines.check_model(self.getModel())
        if self.getOptimizer() is None or self.getLoss() is None:
            raise InvalidArgumentError("optimizer and loss must both be set, e.g. optimizer=keras.optimizers.Adam(1e-3), "
                                       "loss='sparse_categorical_crossentropy'")
        lines.check_same_line(keras_model, self.getOptimizer(), self.getLoss(), self.getMetrics(), self.getCallbacks(),
                              self.getCheckpointCallback())
        callback = lines.check_checkpoint_callback(self.getCheckpointCallback(), line)
        run_url, model_url, options, store_env = self._store()
        launch = self._launch(options, store_env, line)
        feature_cols, label_cols, weight, kinds = self._columns(df, keras_model)
        train_df, val_df = _split(df, self.getValidation(), self.getRandomSeed())
        steps = self._steps(val_df is not None)
        method = self.getMpStartMethod()
        if method is not None and method not in START_METHODS:
            raise InvalidArgumentError(f"mp_start_method={method!r} must be one of {list(START_METHODS)} or None")
        input_names = [t.name for t in keras_model.inputs]
        output_names = list(getattr(keras_model, "output_names", None) or [t.name for t in keras_model.outputs])
        found = shapes.lengths(df, feature_cols + label_cols, kinds)  # a look at one row where the schema cannot tell
        inputs = shapes.model_shapes(keras_model.inputs)
        feature_shapes = shapes.feature_shapes(feature_cols, found, inputs, input_names)
        label_shapes = shapes.label_shapes(label_cols, found, shapes.model_shapes(keras_model.outputs), output_names,
                                           self.getLabelShapes())
        stacked = len(keras_model.inputs) == 1 and len(feature_cols) > 1
        feature_dtypes = dtypes.plan(df.schema, feature_cols, dtypes.of(keras_model.inputs), input_names,
                                     "feature_cols", stacked=stacked)
        label_dtypes = dtypes.plan(df.schema, label_cols, dtypes.of(keras_model.outputs), output_names, "label_cols")
        self._log_hints()
        needed = list(dict.fromkeys(feature_cols + label_cols + ([weight] if weight else [])))
        data = {"train": train_df.select(*needed)}
        if val_df is not None:
            data["val"] = val_df.select(*needed)
        spec = TrainSpec(
            model=keras_bytes(keras_model), input_names=input_names, output_names=output_names,
            optimizer=pack(self.getOptimizer()), loss=pack(self.getLoss()), loss_weights=self.getLossWeights(),
            metrics=pack(self.getMetrics()), callbacks=list(self.getCallbacks() or []),
            custom_objects=self.getCustomObjects(), compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(), feature_cols=feature_cols, label_cols=label_cols,
            sample_weight_col=weight, validation=val_df is not None, batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(), epochs=self.getEpochs(),
            verbose=self.getVerbose(), random_seed=self.getRandomSeed(),
            shuffle=bool(self.getShuffle()) and self.getShuffleBufferSize() != 0, run_url=run_url, model_url=model_url,
            storage_options=options, mlflow=bool(tracking.mlflow_handoff(user_env=launch["env"])),
            registered_model_name=self.getRegisteredModelName(), feature_shapes=feature_shapes,
            label_shapes=label_shapes, train_steps=steps[0], val_steps=steps[1], checkpoint_callback=callback,
            mp_start_method=method, keras_line=line, feature_dtypes=feature_dtypes, label_dtypes=label_dtypes,
            named=self.getRunId() is not None and _has_elastic_url(launch["env"]))
        return spec, data, launch

    def _store(self) -> tuple[str, str, dict | None, dict]:
        """The run's URL, the trained model's URL, the storage options and the ranks' environment for the store."""
        from .. import storage

        store, options, env, name = self.getStore(), self.getStorageOptions(), {}, "model.keras"
        if isinstance(store, Store):
            options = {**store.storage_options, **(options or {})} or None
            env = {"TMPDIR": store.temp_dir} if store.temp_dir else {}
            store, name = store.runs_url, store.model_filename
        elif not isinstance(store, str) or not store:
            raise InvalidArgumentError(
                f"store={store!r}: pass store=Store.create('abfss://container@account.dfs.core.windows.net/models') "
                "(from sparktrain.ml) or the URL itself (any fsspec URL; file:///path for a shared disk)")
        storage.check_url(store, options)
        run_id = self.getRunId()
        if run_id is not None:
            from ..storage.home import check_run_id

            check_run_id(run_id)
        run_url = f"{store.rstrip('/')}/{run_id or 'keras_' + uuid.uuid4().hex[:12]}"
        return run_url, model_url_of(run_url, name), options, env

    def _launch(self, options, store_env, line: str) -> dict[str, Any]:
        """``sparktrain.run``'s keywords: the backend's, the environment (``TF_USE_LEGACY_KERAS`` set
        for the model's Keras line), the storage options."""
        backend, num_proc, run_kwargs, env = self.getBackend(), self.getNumProc(), {}, {}
        if backend is not None:
            if not isinstance(backend, SparkBackend):
                kind = f"{type(backend).__module__}.{type(backend).__qualname__}"
                raise InvalidArgumentError(f"backend must be a sparktrain.ml.SparkBackend (SparkBackend(num_proc=4)), "
                                           f"got {kind}")
            if num_proc is not None:
                raise InvalidArgumentError(f"num_proc={num_proc} and backend=SparkBackend(...) both set the ranks: "
                                           "give num_proc to SparkBackend and leave it off KerasEstimator (as Horovod "
                                           "asks)")
            num_proc, run_kwargs, env = backend.num_proc, backend.run_kwargs(), dict(backend.env)
        for extra in (store_env, self.getBackendEnv(), self.getEnv()):
            env.update(extra or {})
        env = lines.rank_env(line, env)
        use_gpu = False if self.getUseGpu() is False else None  # Horovod's True: a GPU where there is one
        return {"num_proc": num_proc, "verbose": self.getVerbose(), "env": env, "storage_options": options,
                "max_attempts": self.getMaxAttempts(), "use_gpu": use_gpu, **run_kwargs}

    def _columns(self, df, keras_model):
        """The feature, label and weight columns, checked against the DataFrame and the model, and their kinds."""
        feature_cols = list(self.getFeatureCols() or [])
        label_cols = list(self.getLabelCols() or [])
        inputs, outputs = len(keras_model.inputs), len(keras_model.outputs)
        kinds = columns.check_features(df.schema, feature_cols, inputs)
        if not label_cols:
            raise InvalidArgumentError("label_cols is not set: name the label column(s), one per model output")
        kinds += columns.check(df.schema, label_cols, "label columns", "label_cols")
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
        return feature_cols, label_cols, weight, kinds

    def _steps(self, validation: bool) -> tuple[int | None, int | None]:
        train, val = self.getTrainStepsPerEpoch(), self.getValidationStepsPerEpoch()
        for name, value in (("train_steps_per_epoch", train), ("validation_steps_per_epoch", val)):
            if value is not None and value < 1:
                raise InvalidArgumentError(f"{name}={value} must be a positive number of batches, or None for a "
                                           "whole pass over each rank's shard")
        if val is not None and not validation:
            raise InvalidArgumentError(f"validation_steps_per_epoch={val} needs validation rows: set validation=0.1 "
                                       "(a fraction) or validation='is_val' (a boolean column), or leave it out")
        return train, val

    def _log_hints(self) -> None:
        given = [f"{name}={self.getOrDefault(name)!r}" for name in NO_EFFECT
                 if self.isSet(name) and not (name == "shuffle_buffer_size" and self.getShuffleBufferSize() == 0)]
        if given:
            log.warning("KerasEstimator: %s %s no effect here: sparktrain has no Parquet copy of the DataFrame and no "
                        "petastorm reader to tune (each rank memory-maps its shard of the rows, spooled to its "
                        "executor's disk, and shuffles the whole shard each epoch)",
                        ", ".join(given), "has" if len(given) == 1 else "have")


#: Marks rank 0's value of a fit: a named run records it in its home, and a later fit with that
#: ``run_id`` gets it back instead of training.
FIT_RESULT = "sparktrain-keras-estimator/1"


def _train_on_rank(spec):
    from .training import train

    history = train(spec)
    return {"format": FIT_RESULT, "history": history, "model_url": spec.model_url}


def _has_elastic_url(env: dict) -> bool:
    """Whether the elastic_url setting is there (run's env, the driver's environment, the conf): a
    run_id is then a named run of ``sparktrain.run``; without it, Horovod's name of the run's folder
    in the store, as in Horovod."""
    from ..driver import face

    spark = face.active_session()
    conf = face.view_of(spark).conf if spark is not None else {}
    return bool(face.settings_of(conf, {**os.environ, **env}).elastic_url)


def _fit_result(value, run_id: str | None) -> tuple[dict, str]:
    """The history and the model's URL in rank 0's value, of this fit or recorded by an earlier one."""
    if not isinstance(value, dict) or value.get("format") != FIT_RESULT:
        raise InvalidArgumentError(
            f"run_id={run_id!r} names a finished run whose recorded result is not a KerasEstimator fit's (a "
            f"sparktrain.run under the same elastic_url, say): give this fit a run_id of its own")
    return value["history"], value["model_url"]


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
