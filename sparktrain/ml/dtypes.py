"""The dtypes a fit feeds the model, decided on the driver before anything trains.

Each feature reaches its model input in the input's dtype, and each label reaches the loss and
the metrics in its model output's dtype: a double column feeds a float32 input as float32, and a
double label column reaches a float32 output as float32. tf_keras cast labels to the prediction's
dtype before every loss and metric; Keras 3 does not, so a metric written for Keras 2
(``tf.exp(y_true) - tf.exp(y_pred)``) failed on Keras 3 with a float64 label ("Input 'y' of 'Sub'
Op has type float32 that does not match type float64"). The ranks cast once, in their input
pipeline (training.py), where this plan says, on both Keras lines.

A cast that would lose meaning is refused here, naming the column, both dtypes and the fix: a
fractional column (float, double, a Vector) into an integer or boolean input, whose values would
be cut to whole numbers; an integer column into a boolean input; any column into an input that
does not take numbers (a string input). Spark casts such columns explicitly, and then they are
fed as they are.

Pure: Spark types and dtype names in, dtype names out; nothing here imports Keras or TensorFlow.

>>> from pyspark.sql import types as T
>>> schema = T.StructType([T.StructField("sales", T.DoubleType()), T.StructField("store", T.IntegerType())])
>>> plan(schema, ["sales", "store"], ["float32", "int32"], ["out", "store"], "label_cols")
['float32', None]
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError

#: What the feed gives for each Spark scalar type, and for an array's elements (sparktrain.data).
_FED = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
        "FloatType": "float32", "DoubleType": "float64", "BooleanType": "bool"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def fed(data_type) -> str | None:
    """The dtype the ranks read a column of this Spark type in: its scalars' or its elements'. An ml
    Vector is fed as float32 (sparktrain.driver.launch.feed); None for a type the feed has no dtype for."""
    name = type(data_type).__name__
    if name == "VectorUDT":
        return "float32"
    if name == "ArrayType":
        name = type(data_type.elementType).__name__
    return _FED.get(name)


def of(tensors) -> list[str | None]:
    """The dtype names of a model's inputs or outputs, on either Keras line (Keras 3 gives names,
    tf_keras ``tf.DType``); None where a tensor has none."""
    found = []
    for t in tensors:
        dtype = getattr(t, "dtype", None)
        found.append(None if dtype is None else str(getattr(dtype, "name", dtype)))
    return found


def _kind(dtype: str) -> str:
    if dtype == "bool":
        return "bool"
    if dtype in _FLOATS:
        return "float"
    if dtype.startswith(("int", "uint")):
        return "int"
    return "other"


def plan(schema, columns: Sequence[str], targets: Sequence[str | None], names: Sequence[str], param: str,
         stacked: bool = False) -> list[str | None]:
    """Per target (a model input or output), the dtype its column(s) are cast to on the ranks, or
    None where they are fed as they are (the same dtype, or a target of no known dtype).

    ``columns`` pairs with ``targets`` one to one; with ``stacked``, every column feeds the one
    target side by side (the feed stacks them in their common dtype). ``names`` are the targets'
    names, ``param`` the estimator's parameter that named the columns, for the errors.
    """
    fields = {f.name: f.dataType for f in schema.fields}
    groups = [list(columns)] if stacked else [[c] for c in columns]
    casts: list[str | None] = []
    for group, target, name in zip(groups, targets, names):
        sources = [fed(fields[c]) for c in group]
        if target is None or any(s is None for s in sources):
            casts.append(None)
            continue
        for column, source in zip(group, sources):
            _check(column, fields[column], source, target, name, param)
        common = str(np.result_type(*sources)) if len(sources) > 1 else sources[0]
        casts.append(None if common == target else target)
    return casts


def _check(column: str, data_type, source: str, target: str, name: str, param: str) -> None:
    """Refuse a cast from ``source`` to ``target`` that would lose what the values mean."""
    given, wanted = _kind(source), _kind(target)
    what = f"{param}: column {column!r} ({data_type.simpleString()}, fed as {source}) feeds the model's {name!r}"
    if wanted == "other":
        raise InvalidArgumentError(
            f"{what}, which takes {target}: sparktrain feeds numbers only. Build that input to take numbers "
            "(keras.Input(shape=..., dtype='float32')) and turn the values into numbers in Spark first "
            "(pyspark.ml.feature.StringIndexer for categories)")
    cut = (given == "float" and wanted in ("int", "bool")) or (given == "int" and wanted == "bool")
    if cut:
        spark_type = "boolean" if wanted == "bool" else "int" if target in ("int8", "int16", "int32") else "bigint"
        values = "booleans" if wanted == "bool" else "whole numbers"
        raise InvalidArgumentError(
            f"{what}, which takes {target}: casting would cut its values to {values}. Cast the column in Spark "
            f"where its values are {values} (df.withColumn({column!r}, F.col({column!r}).cast({spark_type!r}))), "
            f"or build that input with dtype={source!r}")
