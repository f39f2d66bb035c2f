"""``KerasModel``: the trained model as a Spark ML Model; ``transform(df)`` scores a DataFrame.

Scoring is a scalar Arrow UDF (``pyspark.sql.functions.arrow_udf``, pyspark 4.1 on; before, a
``DataFrame.mapInArrow``), in ``scoring``: each Python worker loads the model once, from the store,
and predicts Arrow batch after Arrow batch, ``batch_size`` rows at a time, without pandas. Only the model's URL, the custom objects and the storage options travel in the task
closure, never the model's bytes. The model is loaded by the
Keras it was trained with (``keras_line``: Keras 3, or tf_keras for a Keras 2 model).
"""
from __future__ import annotations

import uuid

import warnings
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from ..driver.face import without_pyspark_warnings
from . import columns
from .params import MODEL, set_defaults, with_params
from .persistence import StageReader, StageWriter
from .scoring import ArrowScorer, ColumnScorer, load  # noqa: F401 - load: this module's name for it too


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

    def copy(self, extra=None):
        that = super().copy(extra)
        that.__dict__.pop("_scoring_token", None)  # a copy's transform loads its model afresh
        return that

    def _transform(self, dataset):
        from pyspark.sql import functions as F
        from pyspark.sql.types import ArrayType, FloatType, StructField, StructType

        model = self.getModel()
        xs = columns.feature_columns(dataset.schema, self.getFeatureCols(), len(model.inputs))
        out_cols = self.getOutputCols()
        shapes = [tuple(int(d) for d in o.shape[1:]) for o in model.outputs]
        scalar = [all(d == 1 for d in shape) for shape in shapes]
        fields = [StructField(c, FloatType() if s else ArrayType(FloatType())) for c, s in zip(out_cols, scalar)]
        in_shapes = [[int(d) if d is not None else -1 for d in t.shape[1:]] for t in model.inputs]
        keep = list(dataset.columns)
        features = [f"__sparktrain_x{i}" for i in range(len(xs))]
        # The workers keep this model object's model between its transforms, and load a new object's
        # (a new fit, a load, a copy) afresh: a store path written again by a later fit is never stale.
        token = self.__dict__.setdefault("_scoring_token", uuid.uuid4().hex)
        args = (self.getModelUrl(), self.getStorageOptions(), self.getCustomObjects(), self.getKerasLine(), features,
                in_shapes, keep, out_cols, scalar, self.getBatchSize(), token)
        with without_pyspark_warnings():
            try:  # pyspark 4.1 on: a scalar Arrow UDF, which sends only the features to Python
                from pyspark.sql.functions import ArrowUDFType, arrow_udf
            except ImportError:
                staged = dataset.select("*", *[x.alias(f) for x, f in zip(xs, features)])
                return staged.mapInArrow(ArrowScorer(*args), StructType(list(dataset.schema.fields) + fields))
            scorer = ColumnScorer(*args)

            def score(*arrays):
                return scorer(*arrays)

            with warnings.catch_warnings():  # pyspark prefers type hints, which a *args function cannot give
                warnings.filterwarnings("ignore", "It is preferred to specify type hints", UserWarning)
                udf = arrow_udf(score, StructType(fields), ArrowUDFType.SCALAR)
            scored = "__sparktrain_scored"
            out = dataset.withColumn(scored, udf(*xs))
            return out.select("*", *[F.col(f"{scored}.{c}").alias(c) for c in out_cols]).drop(scored)
