"""A Parquet scan's filter, handed to the ranks, and the rows it keeps in each row group.

A DataFrame such as ``spark.read.parquet(path).where("label >= 0 and region in ('eu', 'us')")``
stays a scan the ranks read from the files: the driver turns the optimized plan's filter into the
tree ``sparktrain.data.rowfilter`` evaluates (comparisons of a column with a literal, IN lists,
null tests, AND, OR, NOT, on numeric, boolean and string columns), and one Spark job, spread over
the cluster, counts the rows it keeps in every row group by reading the filter's columns only; so
every rank still knows every rank's count before its first step. A filter with anything else
(casts, functions, two columns compared) is not translated: the DataFrame goes through the stage's
shuffle. The plan's tree is read through the classic session's JVM; a Spark Connect client holds no
such tree, so there a filtered scan goes through the shuffle.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...data.scan import Piece
from ...errors import SparkTrainError

_COMPARE = {"EqualTo": "==", "LessThan": "<", "LessThanOrEqual": "<=", "GreaterThan": ">",
            "GreaterThanOrEqual": ">="}
_FLIPPED = {"==": "==", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_LITERAL_TYPES = {"ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "BooleanType",
                  "StringType"}


class Untranslatable(SparkTrainError):
    """A part of the filter the ranks cannot evaluate."""


def plan_filter(df) -> tuple | None:
    """The filter of ``df``'s optimized plan (a Project over a Filter over the relation, or a
    Filter over it) as a ``rowfilter`` tree; None when the plan has no filter. Raises
    :class:`Untranslatable` for a filter the ranks cannot evaluate, or where the plan's tree cannot
    be had (Spark Connect)."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        raise Untranslatable("a filtered scan over Spark Connect")
    node = jdf.queryExecution().optimizedPlan()
    if _kind(node) == "Project":
        node = node.child()
    if _kind(node) != "Filter":
        return None
    return _tree(node.condition())


def _kind(node) -> str:
    return str(node.getClass().getSimpleName()).rstrip("$")  # Scala objects: BooleanType$


def _tree(e) -> tuple:
    kind = _kind(e)
    if kind in ("And", "Or"):
        return (kind.lower(), _tree(e.left()), _tree(e.right()))
    if kind == "Not":
        inner = e.child()
        if _kind(inner) == "EqualTo":  # != is Not(EqualTo)
            return _compare(inner, negate=True)
        return ("not", _tree(inner))
    if kind == "AttributeReference" and _kind(e.dataType()) == "BooleanType":  # where(F.col("is_val"))
        return ("cmp", "==", _column(e), True)
    if kind in ("IsNull", "IsNotNull"):
        return ("isnull" if kind == "IsNull" else "notnull", _column(e.child()))
    if kind in _COMPARE:
        return _compare(e)
    if kind == "In":
        values = e.list()
        return ("in", _column(e.value()), tuple(_literal(values.apply(i)) for i in range(values.size())))
    if kind == "InSet":
        items = e.hset().toList()
        return ("in", _column(e.child()), tuple(sorted(_value(items.apply(i)) for i in range(items.size()))))
    raise Untranslatable(f"{kind} in the filter")


def _compare(e, negate: bool = False) -> tuple:
    op = "!=" if negate else _COMPARE[_kind(e)]
    left, right = e.left(), e.right()
    if _kind(left) == "Literal" and _kind(right) == "AttributeReference":
        left, right, op = right, left, _FLIPPED.get(op, op)
    return ("cmp", op, _column(left), _literal(right))


def _column(e) -> str:
    if _kind(e) != "AttributeReference":
        raise Untranslatable(f"{_kind(e)} where the filter compares a column")
    return str(e.name())


def _literal(e) -> Any:
    if _kind(e) != "Literal" or _kind(e.dataType()) not in _LITERAL_TYPES:
        raise Untranslatable(f"{_kind(e)} where the filter takes a literal")
    return _value(e.value())


def _value(v) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v.toString())  # Spark's UTF8String


def counted(spark, pieces: Sequence[Piece], tree: tuple, columns: list[str], fmt: str,
            storage_options: Mapping[str, Any] | None = None) -> tuple[Piece, ...]:
    """``pieces`` with the rows ``tree`` keeps in each, counted by one Spark job over the cluster
    (a row group a task), which reads ``columns`` (the filter's) only, with ``storage_options``."""
    import cloudpickle

    rows = [(i, p.path, p.row_group) for i, p in enumerate(pieces)]
    tasks = max(1, min(len(rows), 4 * _parallelism(spark)))
    job = cloudpickle.dumps((tree, columns, fmt, dict(storage_options or {})))
    counts = spark.createDataFrame(rows, "i long, path string, row_group int").repartition(tasks) \
        .mapInArrow(_counter(job), "i long, rows long").collect()
    kept = {int(r["i"]): int(r["rows"]) for r in counts}
    out = []
    for i, p in enumerate(pieces):
        share = kept[i] / p.rows if p.rows else 0.0
        out.append(Piece(p.path, p.row_group, kept[i], int(p.nbytes * share)))
    return tuple(out)


def _parallelism(spark) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return 8


def _counter(job: bytes):
    def count(batches):
        import cloudpickle
        import pyarrow as pa

        from sparktrain.data.scan import Piece, count_kept

        tree, columns, fmt, options = cloudpickle.loads(job)
        for batch in batches:
            items = [Piece(path, rg, 0, 0) for path, rg in zip(batch.column(1).to_pylist(), batch.column(2).to_pylist())]
            kept = count_kept(tree, items, columns, fmt, options)
            yield pa.RecordBatch.from_arrays([batch.column(0), pa.array(kept, pa.int64())], names=["i", "rows"])

    return count
