"""The barrier task's side of ``run(..., data=...)``: spool this task's partition to local disk.

The stage's input rows (see ``sparktrain.driver.launch.feed``) arrive as Arrow record batches of at
most ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows. Each named DataFrame's rows go to
their own Arrow IPC file, uncompressed so the rank can memory-map it and read it without a copy.
Batches are merged into record batches of about :data:`SPOOL_CHUNK` bytes on the way, so the
rank gathers a training batch from few pieces; the task holds at most about two chunks at once.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

from ..data import layout

#: Bytes of rows the task merges into one record batch of the spool file.
SPOOL_CHUNK = 32 << 20


def local_dir() -> str | None:
    """The executor's first local directory (``spark.local.dir``, the node manager's on YARN),
    which Spark hands its Python workers as ``SPARK_LOCAL_DIRS``; None: the system's temp dir."""
    for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if d and os.path.isdir(d):
            return d
    return None


class Spool:
    """This task's share of every named DataFrame, written under ``directory``."""

    def __init__(self, directory: str, names: Sequence[str]):
        self.directory = directory
        self.names = list(names)
        self.rows = {name: 0 for name in self.names}
        self._writers: dict[str, object] = {}
        self._pending: dict[str, list] = {name: [] for name in self.names}
        self._pending_bytes = {name: 0 for name in self.names}

    def consume(self, batches: Iterable) -> dict[str, int]:
        """Spool every batch of the stage's input; returns this task's row count per name."""
        import pyarrow.compute as pc

        try:
            for batch in batches:
                if batch.column(0).null_count:  # the stage's marker row (driver.launch.feed.stage_input)
                    batch = batch.filter(batch.column(0).is_valid())
                if batch.num_rows == 0:
                    continue
                feed = batch.column(0)
                for index, name in enumerate(self.names):
                    rows = batch.column(index + 1)
                    if len(self.names) > 1:
                        rows = pc.filter(rows, pc.equal(feed, index))
                    if len(rows):
                        self._add(name, rows)
            for name in self.names:
                self._flush(name)
        finally:
            for writer in self._writers.values():
                writer.close()
        return dict(self.rows)

    def _add(self, name: str, rows) -> None:
        import pyarrow as pa

        batch = pa.RecordBatch.from_struct_array(rows)
        self._pending[name].append(batch)
        self._pending_bytes[name] += batch.nbytes
        self.rows[name] += batch.num_rows
        if self._pending_bytes[name] >= SPOOL_CHUNK:
            self._flush(name)

    def _flush(self, name: str) -> None:
        import pyarrow as pa

        pending = self._pending[name]
        if not pending:
            return
        merged = pa.Table.from_batches(pending).combine_chunks().to_batches(max_chunksize=None)
        self._pending[name], self._pending_bytes[name] = [], 0
        writer = self._writers.get(name)
        if writer is None:
            path = os.path.join(self.directory, layout.spool_file(name))
            writer = self._writers[name] = pa.ipc.new_file(path, merged[0].schema)
        for b in merged:
            writer.write_batch(b)

    def describe(self, rank: int) -> str:
        """One line for the rank's output: the rows and the disk the spool uses."""
        parts = []
        for name in self.names:
            path = os.path.join(self.directory, layout.spool_file(name))
            size = os.path.getsize(path) if os.path.exists(path) else 0
            parts.append(f"{name} {self.rows[name]:,} rows ({size / 2**20:.1f} MiB)")
        return f"sparktrain rank {rank}: spooled {', '.join(parts)} under {self.directory}"
