"""A scan's filter, as the ranks evaluate it on the rows they read. Pure (pyarrow where used).

The driver writes the filter of a DataFrame's plan (``sparktrain.driver.launch.pushdown``) as a
small tree of tuples, which pickles with the spec and needs no Spark on the rank:

- ``("and", a, b)``, ``("or", a, b)``, ``("not", a)``;
- ``("cmp", op, column, value)`` with ``op`` one of ``== != < <= > >=``;
- ``("isnull", column)``, ``("notnull", column)``; ``("in", column, (value, ...))``.

:func:`mask` evaluates it as Spark's ``WHERE`` does: a row whose condition is null is left out.
"""
from __future__ import annotations

from typing import Any

_COMPARE = {"==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater",
            ">=": "greater_equal"}


def columns(tree) -> set[str]:
    """The columns the filter reads.

    >>> sorted(columns(("and", ("cmp", ">", "a", 1), ("notnull", "b"))))
    ['a', 'b']
    """
    kind = tree[0]
    if kind in ("and", "or"):
        return columns(tree[1]) | columns(tree[2])
    if kind == "not":
        return columns(tree[1])
    return {tree[2] if kind == "cmp" else tree[1]}


def mask(tree, batch):
    """Which rows of ``batch`` (an Arrow record batch holding :func:`columns`) the filter keeps."""
    import pyarrow.compute as pc

    return pc.fill_null(_evaluate(tree, batch), False)


def _evaluate(tree, batch) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = tree[0]
    if kind == "and":
        return pc.and_kleene(_evaluate(tree[1], batch), _evaluate(tree[2], batch))
    if kind == "or":
        return pc.or_kleene(_evaluate(tree[1], batch), _evaluate(tree[2], batch))
    if kind == "not":
        return pc.invert(_evaluate(tree[1], batch))
    if kind == "cmp":
        _, op, column, value = tree
        return getattr(pc, _COMPARE[op])(batch.column(column), pa.scalar(value))
    if kind == "isnull":
        return pc.is_null(batch.column(tree[1]))
    if kind == "notnull":
        return pc.is_valid(batch.column(tree[1]))
    if kind == "in":
        values = batch.column(tree[1])
        return pc.is_in(values, value_set=pa.array(list(tree[2]), type=values.type))
    raise ValueError(f"not a filter: {tree!r}")


def apply(tree, batch, keep: tuple[str, ...]):
    """``batch``'s rows the filter keeps, with only the columns ``keep`` (the DataFrame's)."""
    if tree is not None:
        batch = batch.filter(mask(tree, batch))
    if list(batch.schema.names) != list(keep):
        import pyarrow as pa

        batch = pa.RecordBatch.from_arrays([batch.column(c) for c in keep], names=list(keep))
    return batch
