"""What the estimator and the model read from a DataFrame: the column checks, on the driver before any
job, and the feature columns that scoring (``mapInArrow``) reads.

The column types are the feed's (sparktrain.data): numeric scalars, ``array<numeric>`` and
pyspark.ml Vectors. A model of one input reads one Vector or array column, or several numeric
scalar columns stacked side by side; a model of several inputs reads one column per input, in
the order of ``model.inputs``.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import InvalidArgumentError

_NUMERIC = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "DecimalType",
            "BooleanType")


def kind(dtype) -> str:
    """'scalar', 'array' or 'vector' for the types the feed takes; '' for any other."""
    name = type(dtype).__name__
    if name in _NUMERIC:
        return "scalar"
    if name == "ArrayType" and type(dtype.elementType).__name__ in _NUMERIC:
        return "array"
    if name == "VectorUDT":
        return "vector"
    return ""


def check(schema, columns: Sequence[str], what: str, param: str) -> list[str]:
    """The kinds of ``columns``; refuses a missing column or one of a type the feed cannot read."""
    fields = {f.name: f.dataType for f in schema.fields}
    kinds = []
    for c in columns:
        if c not in fields:
            raise InvalidArgumentError(
                f"{param}: the DataFrame has no column {c!r} (its columns: {sorted(fields)}); name {what} that exist")
        k = kind(fields[c])
        if not k:
            raise InvalidArgumentError(
                f"{param}: column {c!r} is {fields[c].simpleString()}; {what} must be numeric, array<numeric> or an "
                "ml Vector (cast it, index strings with pyspark.ml.feature.StringIndexer, or assemble it with "
                "pyspark.ml.feature.VectorAssembler)")
        kinds.append(k)
    return kinds


def check_features(schema, feature_cols: Sequence[str] | None, inputs: int = 1) -> list[str]:
    """The kinds of the feature columns of a model of ``inputs`` inputs."""
    if not feature_cols:
        raise InvalidArgumentError("feature_cols is not set: name the column(s) the model reads, e.g. "
                                   "feature_cols=['features']")
    kinds = check(schema, feature_cols, "feature columns", "feature_cols")
    if inputs > 1:
        if len(feature_cols) != inputs:
            raise InvalidArgumentError(
                f"feature_cols {list(feature_cols)} name {len(feature_cols)} column(s), and the model has {inputs} "
                "inputs: name one column per input, in the order of model.inputs")
        return kinds
    if len(feature_cols) > 1 and set(kinds) != {"scalar"}:
        raise InvalidArgumentError(
            f"feature_cols {list(feature_cols)}: several columns are stacked into the model's one input, so each "
            "must be a numeric scalar; pass one Vector or array column alone (VectorAssembler makes one)")
    return kinds


def check_boolean(schema, column: str, param: str) -> None:
    fields = {f.name: f.dataType for f in schema.fields}
    if column not in fields or type(fields[column]).__name__ != "BooleanType":
        found = fields[column].simpleString() if column in fields else "missing"
        raise InvalidArgumentError(f"{param}={column!r} must name a boolean column of the DataFrame ({found}); "
                                   "or pass a fraction such as 0.2")


def feature_columns(schema, feature_cols: Sequence[str], inputs: int) -> list:
    """One ``array<float>`` column expression per model input, as scoring reads them."""
    check_features(schema, feature_cols, inputs)
    if inputs == 1:
        return [_as_array(schema, feature_cols)]
    return [_as_array(schema, [c]) for c in feature_cols]


def _as_array(schema, feature_cols: Sequence[str]):
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    kinds = check(schema, feature_cols, "feature columns", "feature_cols")
    if kinds == ["vector"]:
        return vector_to_array(F.col(feature_cols[0]), "float32")
    if kinds == ["array"]:
        return F.col(feature_cols[0]).cast("array<float>")
    return F.array(*[F.col(c).cast("float") for c in feature_cols])
