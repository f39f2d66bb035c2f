"""Saving and loading KerasEstimator and KerasModel, alone or inside a Pipeline.

Spark's own JSON metadata (``DefaultParamsWriter``) holds the params that are JSON: column names,
sizes, the store's URLs, the history. The params that are Python objects (the model to train, the
optimizer, loss, metrics, callbacks, custom objects) are pickled with cloudpickle into one binary
row under ``<path>/objects``, written by Spark, so both go wherever ``save(path)`` points (any
Hadoop filesystem). ``storage_options`` holds credentials and is never saved: set it again after
``load``, or give the executors their credentials another way (their environment, a managed
identity). A KerasModel's trained model stays in the store and is read from there through fsspec.
"""
from __future__ import annotations

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from .params import json_params, object_params

OBJECTS = "objects"


class StageWriter(MLWriter):
    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import cloudpickle

        spark = self.sparkSession
        DefaultParamsWriter.saveMetadata(self.instance, path, spark, paramMap=json_params(self.instance))
        blob = cloudpickle.dumps(object_params(self.instance))
        spark.createDataFrame([(bytearray(blob),)], "objects binary").coalesce(1).write.mode("overwrite").parquet(
            f"{path.rstrip('/')}/{OBJECTS}")


class StageReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        import cloudpickle

        spark = self.sparkSession
        metadata = DefaultParamsReader.loadMetadata(path, spark)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        rows = spark.read.parquet(f"{path.rstrip('/')}/{OBJECTS}").collect()
        instance._set(**cloudpickle.loads(bytes(rows[0][0])))
        return instance
