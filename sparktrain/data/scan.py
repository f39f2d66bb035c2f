"""A fed DataFrame that is a scan of Parquet or ORC files: its pieces, and each rank's share of them.

Pure (pyarrow and fsspec only, imported where used): the driver reads the files' footers into a
:class:`Scan` (``sparktrain.driver.launch.scans``), the spec carries it to every task, and each
rank reads its share (:func:`split`) straight from the files (``sparktrain.data.stream``), with
no shuffle and no spool. A scan's row counts come from the footers (or, for a scan with a filter,
from one counting job that reads the filter's columns), so every rank knows every rank's count
before it reads a row.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence


#: Bytes a Parquet column is read ahead by, as its batches are decoded.
BUFFER_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Piece:
    """One row group of one Parquet file, or one whole ORC file (``row_group`` -1): where it is, its
    rows, and its size uncompressed (the footer's; for ORC, an estimate from the file's size)."""

    path: str
    row_group: int
    rows: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Scan:
    """A DataFrame read from its files: the columns it selects, every row group in file order (with
    the rows its filter keeps), and the filter (``sparktrain.data.rowfilter``; None: every row)."""

    columns: tuple[str, ...]
    pieces: tuple[Piece, ...]
    filter: tuple | None = None
    #: "parquet" or "orc".
    format: str = "parquet"

    @property
    def read_columns(self) -> list[str]:
        """The columns read from the files: the DataFrame's, and those its filter needs."""
        from .rowfilter import columns

        extra = sorted(columns(self.filter) - set(self.columns)) if self.filter is not None else []
        return list(self.columns) + extra

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def split(pieces: Sequence[Piece], size: int) -> list[list[int]]:
    """Each rank's row groups (indices into ``pieces``, in file order): dealt in file order, each
    to the rank with the fewest rows so far (the lowest rank on a tie). A row group goes to a
    rank at the bottom, so no rank is ever more than one row group ahead of another: two ranks'
    counts differ by at most the largest row group.

    >>> split([Piece("f", i, r, 0) for i, r in enumerate([10, 10, 30, 10, 10])], 2)
    [[0, 2], [1, 3, 4]]
    """
    import heapq

    shares: list[list[int]] = [[] for _ in range(size)]
    heap = [(0, rank) for rank in range(size)]
    for index, piece in enumerate(pieces):
        rows, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (rows + piece.rows, rank))
    return shares


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None):
    """``(fsspec filesystem, path)`` for a file Spark names: ``file:`` and plain paths are local,
    ``s3a://``/``s3n://`` are ``s3://``, ``dbfs:/`` is the ``/dbfs`` mount where it exists. A file on
    a store is opened with ``storage_options`` (the run's: ``run(..., storage_options=)``); a local
    one needs none."""
    import fsspec

    if url.startswith(("s3a://", "s3n://")):
        url = "s3://" + url[len("s3a://"):]
    elif url.startswith("dbfs:/") and os.path.isdir("/dbfs"):
        url = "/dbfs/" + url[len("dbfs:/"):].lstrip("/")
    elif url.startswith("file:"):
        from urllib.parse import unquote, urlparse

        url = unquote(urlparse(url).path)
    if "://" not in url:
        return fsspec.core.url_to_fs(url)
    return fsspec.core.url_to_fs(url, **dict(storage_options or {}))


def open_piece(piece: Piece, columns: list[str], fmt: str, rows: int,
               storage_options: Mapping[str, Any] | None = None):
    """The batches of ``piece`` (at most ``rows`` each, ``columns`` only), from a file opened now
    (with ``storage_options``): an error opening it is raised here, one reading it as the batches
    are taken."""
    if fmt == "orc":
        import pyarrow.orc

        fs, path = filesystem(piece.path, storage_options)
        f = fs.open(path, "rb")
        try:
            orc = pyarrow.orc.ORCFile(f)
        except BaseException:
            f.close()
            raise
        return _orc_batches(orc, f, columns, rows)
    parquet, f = open_parquet(piece.path, storage_options)
    return _parquet_batches(parquet, f, piece.row_group, columns, rows)


def _orc_batches(orc, f, columns: list[str], rows: int):
    import pyarrow as pa

    try:
        for stripe in range(orc.nstripes):
            yield from pa.Table.from_batches([orc.read_stripe(stripe, columns=columns)]).to_batches(rows)
    finally:
        f.close()


def _parquet_batches(parquet, f, row_group: int, columns: list[str], rows: int):
    try:
        yield from parquet.iter_batches(batch_size=rows, row_groups=[row_group], columns=columns)
    finally:
        parquet.close()
        if f is not None:
            f.close()


def count_kept(tree, pieces: Sequence[Piece], columns: list[str], fmt: str = "parquet",
               storage_options: Mapping[str, Any] | None = None) -> list[int]:
    """The rows the filter ``tree`` (``rowfilter``) keeps in each of ``pieces``: the counts the
    driver asks the cluster for when a scan has a filter, reading only the filter's columns."""
    import pyarrow.compute as pc

    from .rowfilter import mask

    out = []
    for piece in pieces:
        kept = 0
        for batch in open_piece(piece, columns, fmt, 1 << 16, storage_options):
            kept += pc.sum(mask(tree, batch).cast("int64")).as_py() or 0
        out.append(kept)
    return out


def open_parquet(url: str, storage_options: Mapping[str, Any] | None = None):
    """A ``pyarrow.parquet.ParquetFile`` over ``url`` and the file object under it (close both)."""
    import pyarrow.parquet as pq

    fs, path = filesystem(url, storage_options)
    # Buffered reads: a batch decodes from the pages it needs, not from its whole column chunk.
    if type(fs).__name__ == "LocalFileSystem":
        return pq.ParquetFile(path, memory_map=False, buffer_size=BUFFER_BYTES), None
    f = fs.open(path, "rb")
    try:
        return pq.ParquetFile(f, buffer_size=BUFFER_BYTES), f
    except BaseException:
        f.close()
        raise
