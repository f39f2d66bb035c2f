"""Spark ML stages: :class:`KerasEstimator` trains a Keras model (Keras 3, or tf_keras for Keras 2
code) on a DataFrame across the cluster, and the :class:`KerasModel` it returns scores DataFrames,
alone or inside a ``pyspark.ml`` Pipeline.

    from sparktrain.ml import KerasEstimator
    est = KerasEstimator(model=model, optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy",
                         feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=5,
                         num_proc=3, store="abfss://models@acct.dfs.core.windows.net/churn")
    scored = est.fit(train_df).transform(test_df)      # adds "label__output"

A Horovod estimator script runs with its imports changed: ``SparkBackend`` and ``Store`` take
Horovod's constructors (``KerasEstimator(backend=SparkBackend(num_proc=4), store=Store.create(url), ...)``).

See docs/estimator.md and docs/from-horovod.md. Importing this package imports pyspark, not TensorFlow.
"""
from __future__ import annotations

from .backend import SparkBackend
from .estimator import NO_EFFECT, NOT_SUPPORTED, KerasEstimator
from .model import KerasModel
from .store import Store

__all__ = ["KerasEstimator", "KerasModel", "SparkBackend", "Store", "NOT_SUPPORTED", "NO_EFFECT"]
