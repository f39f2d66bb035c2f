"""``run(..., data=df)`` on the driver: check the DataFrames, then build the barrier stage's input.

The rows never pass through the driver: the named DataFrames become the input of the run's one
barrier ``mapInArrow`` stage, where each task spools its partition to local disk
(``sparktrain.executor.spool``) and the rank reads it (``sparktrain.data``).

Only the DataFrame API is used here (no SparkContext, RDD or Py4J), so the same path serves
Spark Connect sessions.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Mapping

from ...data import layout
from ...errors import InvalidArgumentError

#: What a column may hold, as the error message names it.
SUPPORTED = ("numeric or boolean scalars, fixed-length array<numeric>, pyspark.ml Vector (dense or sparse), "
             "binary, string")
_NUMERIC = {"ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "BooleanType"}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def column_kind(data_type) -> str | None:
    """``"scalar"``, ``"array"``, ``"vector"``, ``"binary"``, ``"string"``, or None when unsupported.

    >>> from pyspark.sql import types as T
    >>> column_kind(T.ArrayType(T.FloatType())), column_kind(T.MapType(T.StringType(), T.IntegerType()))
    ('array', None)
    """
    kind = type(data_type).__name__
    if kind in _NUMERIC:
        return "scalar"
    if kind == "ArrayType":
        return "array" if type(data_type.elementType).__name__ in _NUMERIC else None
    if kind == "VectorUDT":
        return "vector"
    return {"BinaryType": "binary", "StringType": "string"}.get(kind)


def frames_of(data: Any) -> dict[str, Any]:
    """Check ``data=`` and name its DataFrames: a bare DataFrame is ``"train"``.

    Everything here is refused before any Spark job starts. A DataFrame is refused as empty here
    when its plan shows it (``limit(0)``, an always-false filter, an empty range); otherwise only
    reading it can tell, and running it twice (once to look, once to train) would double an
    expensive pipeline's cost, so the ranks refuse it instead, with the same message, right after
    they exchange their row counts and before ``train_fn`` starts.
    """
    from pyspark.sql import DataFrame  # the parent of the classic and the Connect DataFrame

    if isinstance(data, DataFrame):
        frames = {layout.DEFAULT_NAME: data}
    elif isinstance(data, Mapping) and data:
        frames = dict(data)
    else:
        raise InvalidArgumentError(
            f"data must be a Spark DataFrame or a dict of them, such as {{'train': train_df, 'val': val_df}}; "
            f"got {_described(data)}")
    for name, df in frames.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(
                f"data's names must be non-empty strings of letters, digits, '_', '.' or '-' (the rank asks for "
                f"sparktrain.data.dataset(..., name=...)); got {name!r}")
        if not isinstance(df, DataFrame):
            raise InvalidArgumentError(
                f"data[{name!r}] must be a Spark DataFrame, got {_described(df)}")
        if df.isStreaming:
            raise InvalidArgumentError(
                f"data[{name!r}] is a streaming DataFrame; sparktrain trains on a bounded one. Write the stream "
                "to a table first (for example with trigger(availableNow=True)) and pass spark.read.table(...)")
        _check_columns(name, df.schema)
        if _plan_is_empty(df):
            raise InvalidArgumentError(layout.no_rows(name))
    return frames


def _plan_is_empty(df) -> bool:
    """Whether the optimized plan holds at most zero rows; no job runs. False when it cannot tell
    (a Spark Connect DataFrame, whose plan the client does not hold)."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return False
    try:
        rows = jdf.queryExecution().optimizedPlan().maxRows()
        return bool(rows.isDefined()) and int(rows.get()) == 0
    except Exception:  # noqa: BLE001 - only a shortcut; the ranks check again
        return False


def _check_columns(name: str, schema) -> None:
    taken = sorted(layout.RESERVED_COLUMNS & set(schema.names))
    if taken:
        raise InvalidArgumentError(f"data[{name!r}] has column(s) {taken}, whose names sparktrain keeps for itself; "
                                   "rename them")
    bad = [f"{f.name!r} ({f.dataType.simpleString()})" for f in schema.fields if column_kind(f.dataType) is None]
    if bad:
        raise InvalidArgumentError(
            f"data[{name!r}] has column(s) of a type sparktrain cannot feed: {', '.join(bad)}. Supported: "
            f"{SUPPORTED}. Select the columns train_fn uses (df.select(...)), or convert them (for example "
            "F.col('c').cast('double'), or F.to_json for nested values)")


def stage_input(frames: Mapping[str, Any], size: int):
    """The one DataFrame the barrier stage reads: every named DataFrame, in ``size`` partitions.

    It is always repartitioned, round-robin, to ``size`` partitions:
    - a barrier stage must not have ancestors with another number of partitions in the stage
      (a union, coalesce or limit in the DataFrame's plan would be refused or wait for slots);
    - several named DataFrames travel in one stage, and each rank should get its share of each;
    - round-robin gives shards that differ by at most one row, whatever the input's partitions;
    - the partition count is not known without a job over Spark Connect.
    Each row carries a stable id taken before the shuffle, by which the rank orders its shard, so
    the same seed gives the same order in every run. One marker row, whose feed index is null,
    keeps the stage from being empty (see below).
    """
    from pyspark.sql import functions as F

    stage = None
    for index, (name, df) in enumerate(frames.items()):
        columns = [_spooled(df, field) for field in df.schema.fields]
        part = df.select(F.lit(index).cast("tinyint").alias(layout.FEED_COLUMN),
                         F.struct(*columns, F.monotonically_increasing_id().alias(layout.ROW_COLUMN)).alias(name))
        stage = part if stage is None else stage.unionByName(part, allowMissingColumns=True)
    # One marker row of no DataFrame (a null feed index; the task's spool drops it) keeps the
    # shuffle from being empty. pyspark 3.5's adaptive execution turns an empty shuffle into an
    # empty relation of no partitions, and the barrier stage then ran no task at all: the run
    # returned None without train_fn, instead of the ranks' "has no rows".
    marker = stage.sparkSession.range(0, 1, 1, 1).select(F.lit(None).cast("tinyint").alias(layout.FEED_COLUMN))
    return stage.unionByName(marker, allowMissingColumns=True).repartition(size)


def _spooled(df, field):
    """The column as it is spooled: ml Vectors become dense float32 arrays (Keras' default float)."""
    if column_kind(field.dataType) == "vector":
        from pyspark.ml.functions import vector_to_array

        return vector_to_array(df[_quoted(field.name)], "float32").alias(field.name)
    return df[_quoted(field.name)]


def _quoted(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"  # a dot in a name is not a nested field


def _described(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    top = sys.modules.get(module.split(".")[0])
    if getattr(top, kind.__qualname__, None) is kind:  # the public name: pandas 1.x says pandas.core.frame
        module = top.__name__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    text = " ".join(repr(value).split())
    text = text if len(text) <= 80 else text[:77] + "..."
    hint = "; make it a Spark DataFrame with spark.createDataFrame(...)" if name.startswith("pandas.") else ""
    return f"{text} ({name}){hint}"
