"""The shapes a fit feeds the model, decided on the driver before anything trains.

A feature column holds ``n`` values per row (1 for a scalar, the length of an array or ml Vector,
dense or sparse). Where the model's input takes a shape of ``n`` values in all (784 values for
an input of ``(28, 28, 1)``), each rank reshapes the column's rows to it, as Horovod's estimator
does; any other length is refused here, naming the column, the lengths and the fix. A label is
reshaped to its ``label_shapes`` entry (Horovod's parameter) when one is given, or else to its
model output's shape when it has as many values (``(batch,)`` to ``(batch, 1)`` for an output of
one value, so that a metric function sees ``y_true`` in ``y_pred``'s shape on Keras 3 too); a
label of one value for an output of several is left alone (sparse losses take class ids), and any
other length is refused (the rule is sparktrain.data.shaping's).

A Vector column's length comes from its ML attributes, which Spark's feature stages
(VectorAssembler, OneHotEncoder) and the libsvm reader write; otherwise, and for arrays, from the
first row: one small Spark job.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..data.shaping import label_target
from ..errors import InvalidArgumentError

Shape = tuple


def model_shapes(tensors) -> list[Shape]:
    """The shapes of a model's inputs or outputs, batch left out; None for a dimension left open."""
    return [tuple(None if d is None else int(d) for d in t.shape[1:]) for t in tensors]


def lengths(df, columns: Sequence[str], kinds: Sequence[str]) -> dict[str, int | None]:
    """Values per row of each column: 1 for a scalar; an array's or Vector's length (None where the
    DataFrame has no rows to tell)."""
    fields = {f.name: f for f in df.schema.fields}
    found: dict[str, int | None] = {}
    unknown = []
    for column, kind in zip(columns, kinds):
        size = (fields[column].metadata or {}).get("ml_attr", {}).get("num_attrs") if kind == "vector" else None
        if kind == "scalar":
            found[column] = 1
        elif isinstance(size, int) and size >= 0:
            found[column] = size
        else:
            unknown.append((column, kind))
    if unknown:
        from pyspark.ml.functions import vector_to_array
        from pyspark.sql import functions as F

        def size_of(column, kind):
            col = F.col("`" + column.replace("`", "``") + "`")
            return F.size(vector_to_array(col) if kind == "vector" else col)

        row = df.select(*[size_of(c, k).alias(f"n{i}") for i, (c, k) in enumerate(unknown)]).first()
        for i, (column, _) in enumerate(unknown):
            value = None if row is None else row[i]
            found[column] = value if isinstance(value, int) and value >= 0 else None
    return found


def feature_shapes(feature_cols: Sequence[str], found: dict[str, int | None], inputs: Sequence[Shape],
                   input_names: Sequence[str]) -> list[Shape | None]:
    """Per model input, the shape its rows are reshaped to (None: fed as they are)."""
    if len(inputs) == 1 and len(feature_cols) > 1:  # scalar columns stacked side by side
        what = f"feature_cols {list(feature_cols)} stack {len(feature_cols)} columns into one input, and"
        return [_target(len(feature_cols), inputs[0], what, input_names[0])]
    return [_target(found[c], shape, f"feature_cols: column {c!r} holds {found[c]} value(s) per row, and", name)
            for c, shape, name in zip(feature_cols, inputs, input_names)]


def _target(n: int | None, shape: Shape, what: str, name: str) -> Shape | None:
    if any(d is None for d in shape):
        return None  # an open dimension: the model takes what comes
    if n is None or n == math.prod(shape):
        return shape
    raise InvalidArgumentError(
        f"{what} the model's input {name!r} takes shape {shape}, {math.prod(shape)} value(s) per row. Feed it "
        f"{math.prod(shape)} values per row (a Vector of that length, e.g. from VectorAssembler or the libsvm "
        f"reader's numFeatures), or build the model with keras.Input(shape=({n},))")


def label_shapes(label_cols: Sequence[str], found: dict[str, int | None], outputs: Sequence[Shape],
                 output_names: Sequence[str], given: Any = None) -> list[Shape | None]:
    """Per label column, the shape its rows are reshaped to (None: fed as they are)."""
    if given is not None:
        shapes = _given_shapes(given, label_cols)
        for column, shape in zip(label_cols, shapes):
            n = found[column]
            if n is not None and n != math.prod(shape):
                raise InvalidArgumentError(
                    f"label_shapes gives label column {column!r} shape {shape}, {math.prod(shape)} value(s), and the "
                    f"column holds {n} per row: give it a shape of {n} values, e.g. ({n},)")
        return shapes
    targets: list[Shape | None] = []
    for column, shape, name in zip(label_cols, outputs, output_names):
        n = found[column]
        try:  # (batch,) to (batch, 1) for an output of one value; a class id for n classes as it is
            targets.append(label_target(n, shape))
        except ValueError:
            raise InvalidArgumentError(
                f"label_cols: column {column!r} holds {n} value(s) per row, and the model's output {name!r} has shape "
                f"{shape}, {math.prod(shape)} value(s). Give the label {math.prod(shape)} values (for classes, "
                f"OneHotEncoder(dropLast=False) makes one per class), or pass label_shapes=[({n},)] if the loss takes "
                "labels of another shape") from None
    return targets


def _given_shapes(given: Any, label_cols: Sequence[str]) -> list[Shape]:
    example = ", ".join(["(10,)"] * len(label_cols))
    if isinstance(given, (list, tuple)) and given and all(isinstance(d, int) for d in given) and len(label_cols) == 1:
        given = [given]  # one label's shape alone
    ok = (isinstance(given, (list, tuple)) and len(given) == len(label_cols)
          and all(isinstance(s, (list, tuple)) and s and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                             for d in s) for s in given))
    if not ok:
        raise InvalidArgumentError(
            f"label_shapes={given!r} must give one shape of positive ints per label column {list(label_cols)}, "
            f"e.g. label_shapes=[{example}]")
    return [tuple(s) for s in given]
