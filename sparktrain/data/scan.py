"""A fed DataFrame that is a scan of Parquet files: its row groups, and each rank's share of them.

Pure (pyarrow and fsspec only, imported where used): the driver reads the files' footers into a
:class:`Scan` (``sparktrain.driver.launch.feed``), the spec carries it to every task, and each
rank reads its share (:func:`split`) straight from the files (``sparktrain.data.stream``), with
no shuffle and no spool. A scan's row counts come from the footers, so every rank knows every
rank's count before it reads a row.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """One row group of one file: where it is, its rows, and its size uncompressed (the footer's)."""

    path: str
    row_group: int
    rows: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Scan:
    """A DataFrame read from its files: the columns it selects, and every row group, in file order."""

    columns: tuple[str, ...]
    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def split(pieces: Sequence[Piece], size: int) -> list[list[int]]:
    """Each rank's row groups (indices into ``pieces``), contiguous in file order, cut at the
    row-group boundary nearest each rank's even share of the rows: every rank's count is within
    half a row group of the even share at each of its ends, so two ranks differ by at most one
    row group.

    >>> split([Piece("f", i, 10, 0) for i in range(5)], 2)
    [[0, 1], [2, 3, 4]]
    """
    total = sum(p.rows for p in pieces)
    ends = []
    done = 0
    for p in pieces:
        ends.append(done + p.rows)
        done += p.rows
    cuts = [0]
    for k in range(1, size):
        target = total * k / size
        best = min(range(cuts[-1], len(pieces) + 1),
                   key=lambda i: abs((ends[i - 1] if i else 0) - target))
        cuts.append(best)
    cuts.append(len(pieces))
    return [list(range(cuts[k], cuts[k + 1])) for k in range(size)]


def rows_per_rank(scan: Scan, size: int) -> list[int]:
    return [sum(scan.pieces[i].rows for i in share) for share in split(scan.pieces, size)]


def filesystem(url: str):
    """``(fsspec filesystem, path)`` for a file Spark names: ``file:`` and plain paths are local,
    ``s3a://``/``s3n://`` are ``s3://``, ``dbfs:/`` is the ``/dbfs`` mount where it exists."""
    import fsspec

    if url.startswith(("s3a://", "s3n://")):
        url = "s3://" + url[len("s3a://"):]
    elif url.startswith("dbfs:/") and os.path.isdir("/dbfs"):
        url = "/dbfs/" + url[len("dbfs:/"):].lstrip("/")
    elif url.startswith("file:"):
        from urllib.parse import unquote, urlparse

        url = unquote(urlparse(url).path)
    return fsspec.core.url_to_fs(url)


def open_parquet(url: str):
    """A ``pyarrow.parquet.ParquetFile`` over ``url`` and the file object under it (close both)."""
    import pyarrow.parquet as pq

    fs, path = filesystem(url)
    if type(fs).__name__ == "LocalFileSystem":
        return pq.ParquetFile(path, memory_map=False), None
    f = fs.open(path, "rb")
    try:
        return pq.ParquetFile(f), f
    except BaseException:
        f.close()
        raise
