"""``KerasModel``: the trained model as a Spark ML Model; ``transform(df)`` scores a DataFrame.

Scoring is ``pyspark.ml.functions.predict_batch_udf``: each Python worker loads the model once,
from the store, and predicts batch after batch. Only the model's URL, the custom objects and the
storage options travel in the task closure, never the model's bytes. The model is loaded by the
Keras it was trained with (``keras_line``: Keras 3, or tf_keras for a Keras 2 model).
"""
from __future__ import annotations

from typing import Any

from pyspark import keyword_only
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from ..driver.cluster import without_pyspark_warnings
from ..kerasline import KERAS_3
from . import columns
from .params import MODEL, set_defaults, with_params
from .persistence import StageReader, StageWriter


@with_params(MODEL)
class KerasModel(Model, MLReadable, MLWritable):
    """A model trained by :class:`~sparktrain.ml.KerasEstimator`; ``transform`` adds one prediction
    column per label (``<label>__output``, or ``output_cols``): a float for a model output of one
    value, an ``array<float>`` otherwise. The model is loaded by the Keras it was trained with
    (``getKerasLine()``: ``"keras"`` for Keras 3, ``"tf_keras"`` for Keras 2)."""

    @keyword_only
    def __init__(self, **kwargs: Any):
        super().__init__()
        set_defaults(self)
        self._set(**self._input_kwargs)
        self._keras_model = None

    def write(self) -> StageWriter:
        return StageWriter(self)

    @classmethod
    def read(cls) -> StageReader:
        return StageReader(cls)

    def getModel(self):  # noqa: N802 - Horovod's name
        """The trained Keras model, read from the store (once per KerasModel)."""
        if self._keras_model is None:
            self._keras_model = load(self.getModelUrl(), self.getStorageOptions(), self.getCustomObjects(),
                                     self.getKerasLine())
        return self._keras_model

    def getHistory(self) -> dict:  # noqa: N802 - Horovod's name
        """The training history: ``{metric: [value per epoch]}``, averaged over the ranks."""
        return dict(self.getOrDefault("history") or {})

    def getOutputCols(self) -> list[str]:  # noqa: N802
        return list(self.getOrDefault("output_cols") or [f"{c}__output" for c in self.getLabelCols()])

    def _transform(self, dataset):
        from pyspark.ml.functions import predict_batch_udf
        from pyspark.sql import functions as F
        from pyspark.sql.types import ArrayType, FloatType, StructField, StructType

        model = self.getModel()
        xs = columns.feature_columns(dataset.schema, self.getFeatureCols(), len(model.inputs))
        out_cols = self.getOutputCols()
        shapes = [tuple(int(d) for d in o.shape[1:]) for o in model.outputs]
        scalar = [all(d == 1 for d in shape) for shape in shapes]
        fields = [StructField(c, FloatType() if s else ArrayType(FloatType())) for c, s in zip(out_cols, scalar)]
        in_shapes = [[int(d) if d is not None else -1 for d in t.shape[1:]] for t in model.inputs]
        with without_pyspark_warnings():
            predict = predict_batch_udf(
                _Loader(self.getModelUrl(), self.getStorageOptions(), self.getCustomObjects(), out_cols, scalar,
                        self.getKerasLine()),
                return_type=StructType(fields), batch_size=self.getBatchSize(), input_tensor_shapes=in_shapes)
        scored = "__sparktrain_scored"
        out = dataset.withColumn(scored, predict(*xs))
        return out.select("*", *[F.col(f"{scored}.{c}").alias(c) for c in out_cols]).drop(scored)


def load(url: str, storage_options=None, custom_objects=None, line: str = KERAS_3):
    """The Keras model at ``url`` in the store, for prediction (not compiled), loaded by the Keras of
    ``line`` (``"keras"``: Keras 3; ``"tf_keras"``)."""
    import os
    import tempfile

    from .. import storage
    from ..host import tflog

    # TensorFlow's start-up lines (its import, and the first op's look for a GPU) are filtered as a
    # rank's are, without changing this process's environment: a driver's later runs in local mode,
    # whose ranks inherit it, keep their verbosity.
    quiet = tflog.filtered_stderr(tflog.level_from_env(unset=2))
    with quiet, tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        from .portable import load_file

        local = os.path.join(tmp, "model.keras")
        storage.get_file(url, local, storage_options)
        return load_file(local, custom_objects, line)


class _Loader:
    """``predict_batch_udf``'s make_predict_fn: loads the model in the Python worker, once."""

    def __init__(self, url, storage_options, custom_objects, out_cols, scalar, line=KERAS_3):
        self.url, self.storage_options, self.custom_objects = url, storage_options, custom_objects
        self.out_cols, self.scalar, self.line = list(out_cols), list(scalar), line

    def __call__(self):
        import inspect

        import numpy as np

        model = load(self.url, self.storage_options, self.custom_objects, self.line)
        out_cols, scalar = self.out_cols, self.scalar

        def predict(*xs):
            outs = model.predict_on_batch(list(xs) if len(xs) > 1 else xs[0])
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            n = len(xs[0])
            return {c: (np.asarray(o).reshape(n) if s else np.asarray(o).reshape(n, -1)).astype(np.float32)
                    for c, o, s in zip(out_cols, outs, scalar)}

        # predict_batch_udf counts the function's parameters to know how many inputs it takes.
        predict.__signature__ = inspect.Signature(
            [inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(len(model.inputs))])
        return predict
