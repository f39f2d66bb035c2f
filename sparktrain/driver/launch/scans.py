"""Which fed DataFrames the ranks read straight from their Parquet or ORC files, and their pieces.

A DataFrame whose optimized plan is a Parquet scan (or an ORC scan: each file a piece), with at most a choice of its columns and a
filter the ranks can evaluate (``pushdown``; no computed column, no limit), needs no Spark stage
to reach the ranks: the driver reads
the files' footers here (their row groups and row counts, a few KiB a file, in a pool of threads),
and each rank reads its share of the row groups itself (``sparktrain.data.scan``,
``sparktrain.data.stream``). Any other plan, or a scan whose files the driver cannot read with
fsspec, travels through the run's barrier stage as before (``feed.stage_input``); the run's log
says which and why.

Only the DataFrame API is used (the plan's text, ``inputFiles``), so the same path serves classic and
Spark Connect sessions.
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from ...data import layout
from ...data.scan import Piece, Scan, open_parquet
from ...errors import InvalidArgumentError, SparkTrainError
from . import pushdown
from .feed import column_kind

log = logging.getLogger("sparktrain")

_ATTRIBUTE = r"[^\s,\[\]]+#\d+L?"
_PLAN = re.compile(rf"^(?:Project \[(?:{_ATTRIBUTE})(?:, {_ATTRIBUTE})*\]\n\+- )?(?P<filter>Filter [^\n]*\n *\+- )?"
                   rf"Relation (?:\S+ )?\[[^\n]*\] (?P<format>parquet|orc)$")
#: Threads that read the footers.
FOOTER_THREADS = 16


def file_scans(frames: Mapping[str, Any], size: int, storage_options: Mapping[str, Any] | None = None
               ) -> dict[str, Scan]:
    """The fed DataFrames the ranks can read from their files, by name, each split into at least
    ``size`` row groups' worth (a DataFrame of fewer row groups than ranks goes through Spark).
    The files are read with ``storage_options`` (``run``'s), here and in the ranks."""
    out = {}
    for name, df in frames.items():
        reason, scan = _scan(name, df, storage_options)
        if scan is not None and len(scan.pieces) < size:
            reason, scan = f"its {len(scan.pieces)} row group(s) are fewer than the {size} ranks", None
        if scan is None:
            log.info("sparktrain: data[%r] goes through the run's Spark stage (one shuffle): %s", name, reason)
            continue
        log.info("sparktrain: data[%r] is read by the ranks from its files: %d rows in %d row groups of %d file(s)",
                 name, scan.rows, len(scan.pieces), len({p.path for p in scan.pieces}))
        out[name] = scan
    return out


def _scan(name: str, df, storage_options: Mapping[str, Any] | None) -> tuple[str, Scan | None]:
    plan = optimized_plan(df)
    shape = _PLAN.match(plan.strip()) if plan is not None else None
    if shape is None:
        return "its plan is not a scan of Parquet or ORC files (with at most a choice of columns and a filter)", None
    fmt = shape.group("format")
    tree = None
    if shape.group("filter"):
        try:
            tree = pushdown.plan_filter(df)
        except pushdown.Untranslatable as e:
            return f"its filter holds what the ranks cannot evaluate: {e}", None
    if any(column_kind(f.dataType) == "vector" for f in df.schema.fields):
        return "it holds ml Vectors, which Spark converts", None
    files = sorted(df.inputFiles())
    if not files:
        return "it has no files", None
    columns = tuple(df.schema.names)
    needed = columns + tuple(sorted(_filter_columns(tree) - set(columns)))
    try:
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(files))) as pool:
            footers = list(pool.map(lambda f: (_orc_footer if fmt == "orc" else _footer)(f, needed, storage_options),
                                    files))
    except _NotDirect as e:
        return str(e), None
    except Exception as e:  # noqa: BLE001 - a file this process cannot read: Spark reads it instead
        return f"the driver could not read its files' footers ({type(e).__name__}: {e})", None
    types = {f[0] for f in footers}
    if len(types) > 1:
        return "its files hold the columns in different types", None
    pieces = tuple(p for _, ps, _ in footers for p in ps)
    if tree is not None:  # the footers count every row; the filter's own counts come from the cluster
        pieces = pushdown.counted(df.sparkSession, pieces, tree, sorted(_filter_columns(tree)), fmt, storage_options)
        footers = []  # the statistics' null counts include rows the filter leaves out
    nulls = {}
    for _, _, counts in footers:
        for column, n in counts.items():
            nulls[column] = nulls.get(column, 0) + n
    bad = {c: n for c, n in nulls.items() if n}
    if bad:
        column, n = next(iter(bad.items()))
        raise InvalidArgumentError(
            f"data[{name!r}]: column {column!r} has {n} null value(s) (the files' statistics say so); fill or drop "
            f"them in Spark (df.fillna(...) or df.dropna(subset=[{column!r}]))")
    scan = Scan(columns=columns, pieces=tuple(p for p in pieces if p.rows), filter=tree, format=fmt)
    if scan.rows == 0:
        raise InvalidArgumentError(layout.no_rows(name))
    return "", scan


def _filter_columns(tree) -> set[str]:
    from ...data.rowfilter import columns

    return columns(tree) if tree is not None else set()


class _NotDirect(SparkTrainError):
    """A file of the scan that the ranks could not read as Spark does."""


def _footer(url: str, columns: tuple[str, ...], storage_options: Mapping[str, Any] | None):
    """``(the columns' Arrow types, the file's row groups, null counts of its scalar columns)``."""
    parquet, f = open_parquet(url, storage_options)
    try:
        schema = parquet.schema_arrow
        _check_names(url, columns, schema.names)
        meta = parquet.metadata
        paths = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
        pieces, nulls = [], {c: 0 for c in columns if c in paths}
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            pieces.append(Piece(url, i, rg.num_rows, rg.total_byte_size))
            for c in nulls:
                stats = rg.column(paths[c]).statistics
                if stats is not None and stats.has_null_count:
                    nulls[c] += stats.null_count
        return tuple(str(schema.field(c).type) for c in columns), pieces, nulls
    finally:
        parquet.close()
        if f is not None:
            f.close()


def _orc_footer(url: str, columns: tuple[str, ...], storage_options: Mapping[str, Any] | None):
    """An ORC file as one piece (pyarrow gives no stripe's row count without reading it); its
    nulls are the rank's to find."""
    import pyarrow.orc

    from ...data.scan import filesystem

    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        orc = pyarrow.orc.ORCFile(f)
        schema = orc.schema
        _check_names(url, columns, schema.names)
        width = sum(schema.field(c).type.bit_width // 8 if pyarrow.types.is_primitive(schema.field(c).type) else 64
                    for c in columns)
        return tuple(str(schema.field(c).type) for c in columns), [Piece(url, -1, orc.nrows, orc.nrows * width)], {}


def _check_names(url: str, columns: tuple[str, ...], names) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise _NotDirect(f"its column(s) {missing} are not in {url} as named (partition columns, or "
                         "names Spark matched without case)")


def optimized_plan(df) -> str | None:
    """The DataFrame's optimized logical plan as Spark prints it; None where it cannot be had."""
    jdf = getattr(df, "_jdf", None)
    try:
        if jdf is not None:
            return str(jdf.queryExecution().optimizedPlan().toString())
        text = df._explain_string(mode="extended")  # Spark Connect: the server's plan
    except Exception:  # noqa: BLE001 - without the plan, the stage's shuffle serves
        return None
    found = re.search(r"== Optimized Logical Plan ==\n(.*?)\n\n== Physical Plan ==", text, re.S)
    return found.group(1) if found else None
