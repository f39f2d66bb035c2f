"""Saving and loading KerasEstimator and KerasModel, alone or inside a Pipeline.

Spark's own JSON metadata (``DefaultParamsWriter``) holds the params that are JSON: column names,
sizes, the store's URLs, the history. The params that are Python objects (the model to train, the
optimizer, loss, metrics, callbacks, custom objects, the backend, a Store) are pickled with
cloudpickle into one binary row under ``<path>/objects``, written by Spark, so both go wherever
``save(path)`` points (any Hadoop filesystem). Keras objects are pickled in the form that
``portable`` gives them, which every Keras 3 release and tf_keras load back (Keras 3.2's and
tf_keras' optimizers, and Keras 3.2's models, do not pickle); a tf_keras model comes back a
tf_keras model. A KerasModel's Keras (``keras_line``) is one of its JSON params. ``storage_options`` and a Store's credentials are never saved: set them
again after ``load``, or give the executors their credentials another way (their environment, a
managed identity). A KerasModel's trained model stays in the store and is read from there
through fsspec.

pyspark 3.5's ``DefaultParamsWriter.saveMetadata`` and ``DefaultParamsReader.loadMetadata`` take
a SparkContext, pyspark 4's a SparkSession (or a SparkContext): each is handed what its
signature says it takes.
"""
from __future__ import annotations

import inspect

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from .params import json_params, object_params

OBJECTS = "objects"


def _context_for(method, spark):
    """``spark``, or its SparkContext where ``method``'s ``sc`` parameter does not take a SparkSession."""
    annotation = inspect.signature(method).parameters["sc"].annotation
    if annotation is inspect.Parameter.empty or "SparkSession" in str(annotation):
        return spark
    return spark.sparkContext


class StageWriter(MLWriter):
    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import cloudpickle

        from .portable import pack
        from .store import Store

        spark = self.sparkSession
        DefaultParamsWriter.saveMetadata(self.instance, path, _context_for(DefaultParamsWriter.saveMetadata, spark),
                                         paramMap=json_params(self.instance))
        objects = {name: value.without_credentials() if isinstance(value, Store) else pack(value)
                   for name, value in object_params(self.instance).items()}
        blob = cloudpickle.dumps(objects)
        spark.createDataFrame([(bytearray(blob),)], "objects binary").coalesce(1).write.mode("overwrite").parquet(
            f"{path.rstrip('/')}/{OBJECTS}")


class StageReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        import cloudpickle

        from .portable import unpack

        spark = self.sparkSession
        metadata = DefaultParamsReader.loadMetadata(path, _context_for(DefaultParamsReader.loadMetadata, spark))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        rows = spark.read.parquet(f"{path.rstrip('/')}/{OBJECTS}").collect()
        objects = cloudpickle.loads(bytes(rows[0][0]))
        custom_objects = objects.get("custom_objects")
        instance._set(**{name: unpack(value, custom_objects) for name, value in objects.items()})
        return instance
