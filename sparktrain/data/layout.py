"""The spool's layout: what the barrier task writes and the rank reads. Pure: shared by the
driver (which builds the stage's input), the task (which spools it) and the rank (which reads it).

The barrier stage's input has one column :data:`FEED_COLUMN` (which named DataFrame a row
belongs to, by position in the run's ``feed`` names) and one struct column per name holding
that DataFrame's columns plus :data:`ROW_COLUMN`, a stable row id that fixes the shard's order
whatever order the shuffle delivered the rows in. One row of the input belongs to no DataFrame:
its :data:`FEED_COLUMN` is null (it keeps the stage from being empty); the task drops it.
"""
from __future__ import annotations

import json
import os

#: Which named DataFrame a row of the stage's input belongs to (its index in the feed's names).
FEED_COLUMN = "_sparktrain_feed"
#: A stable id per row (Spark's monotonically increasing id), taken before the repartition.
ROW_COLUMN = "_sparktrain_row"
#: Column names the user's DataFrames may not use.
RESERVED_COLUMNS = frozenset({FEED_COLUMN, ROW_COLUMN})
#: The manifest the task writes into the spool directory once every rank's row counts are known.
MANIFEST = "feed.json"
#: The name a bare ``data=df`` gets.
DEFAULT_NAME = "train"


def no_rows(name: str) -> str:
    """Why a run stops when a fed DataFrame has no rows (the driver's and the ranks' message)."""
    return f"data[{name!r}] has no rows; there is nothing to train on"


def spool_file(name: str) -> str:
    """The Arrow IPC file that holds named DataFrame ``name``'s rows of this rank."""
    return f"{name}.arrow"


def write_manifest(directory: str, rank: int, rows: dict[str, list[int]], scans: dict | None = None) -> None:
    """Record every rank's row count per name (``rows[name][rank]``) beside the spool files, and,
    for each DataFrame the rank reads from its files, its columns and this rank's row groups."""
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"rank": rank, "rows": rows, "scans": scans or {}}, f)


def scan_shares(scans, size: int, rank: int, rows: dict[str, list[int]]) -> dict:
    """The manifest's ``scans`` for ``rank`` of ``size``: each scanned DataFrame's columns and this
    rank's row groups (``sparktrain.data.scan.split``); every rank's count goes into ``rows``."""
    import dataclasses

    from .scan import split

    out = {}
    for name, scan in scans:
        shares = split(scan.pieces, size)
        rows[name] = [sum(scan.pieces[i].rows for i in share) for share in shares]
        out[name] = {"columns": list(scan.columns), "filter": scan.filter, "read": scan.read_columns,
                     "format": scan.format,
                     "pieces": [dataclasses.asdict(scan.pieces[i]) for i in shares[rank]]}
    return out


def read_manifest(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST)) as f:
        return json.load(f)
