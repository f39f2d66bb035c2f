"""This rank's share of a scanned DataFrame, read from its Parquet or ORC files while the rank trains.

The rank's row groups (``sparktrain.data.scan.split``) are read :data:`READ_ROWS` rows at a time,
each epoch in a new order of row groups drawn from the seed, the rows mixed in a shuffle buffer
before they are batched (the epoch's first buffer one read, each next twice as large, up to
:data:`SHUFFLE_ROWS`); so an epoch's first batch waits for one read only.
What is read is kept in a local cache, uncompressed Arrow files beside the rank's work directory,
up to the ``data_cache_limit`` setting: an epoch reads what the cache holds from there and the rest
from the files again, and once the cache holds the whole shard, each epoch is a full permutation
of it, gathered memory-mapped. The cache goes with the rank's task, as the spool does.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
from typing import Iterator

import numpy as np

from ..errors import InvalidArgumentError, SparkTrainError
from . import rowfilter
from .scan import Piece, open_piece
from .shard import Counts, Window

#: Rows per read from a row group: the first batch waits for one read.
READ_ROWS = 1 << 16
#: Rows the shuffle buffer mixes at a time while rows stream in.
SHUFFLE_ROWS = 1 << 18


def cache_limit(directory: str, local_size: int, setting) -> int:
    """Bytes this rank may keep in its cache: the setting, or, for 'auto', half of the free space
    of ``directory``'s disk shared among the host's ranks."""
    if setting != "auto":
        return int(setting)
    free = shutil.disk_usage(directory).free
    return free // 2 // max(1, local_size)


class Cache:
    """Row groups this rank has read, as Arrow IPC files under ``directory``, up to ``limit`` bytes
    on disk: a row group is kept only if it fits whole (one that would pass the limit is not
    written, or removed as soon as its size shows it), so the disk holds at most the limit and one
    row group."""

    def __init__(self, directory: str, limit: int):
        self.directory = directory
        self.limit = limit
        self.used = 0
        self.held: dict[int, str] = {}
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)

    def claim(self, index: int, piece: Piece) -> bool:
        """Whether to write row group ``index`` now (it may fit, and nobody else is writing it)."""
        with self._lock:
            if index in self.held or index in self._busy or self.used + piece.nbytes > self.limit:
                return False
            self._busy.add(index)
            return True

    def writer(self, index: int):
        return _CacheWriter(self, index)

    def batches(self, index: int) -> list:
        import pyarrow as pa

        reader = pa.ipc.open_file(pa.memory_map(self.held[index], "r"))
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


class _CacheWriter:
    """One row group on its way into the cache, written as one record batch when it is whole (a
    gather over the cached shard then takes from one piece per row group): :meth:`done` keeps it,
    :meth:`drop` leaves nothing."""

    def __init__(self, cache: Cache, index: int):
        self.cache, self.index = cache, index
        self.path = os.path.join(cache.directory, f"{index}.arrow")
        self.part = self.path + ".part"
        self._batches: list = []
        self._bytes = 0
        self.ok = True

    def write(self, batch) -> None:
        if not self.ok:
            return
        self._batches.append(batch)
        self._bytes += batch.nbytes
        if self.cache.used + self._bytes > self.cache.limit:
            self.drop()

    def done(self) -> None:
        import pyarrow as pa

        if not self.ok or not self._batches:
            return self.drop()
        joined = _joined(self._batches)
        self._batches = []
        try:
            with pa.ipc.new_file(self.part, joined[0].schema) as writer:
                for b in joined:
                    writer.write_batch(b)
            size = os.path.getsize(self.part)
            if self.cache.used + size > self.cache.limit:
                return self.drop()
            os.replace(self.part, self.path)
        except OSError:  # a full or failing local disk: the row group is read from its file again
            return self.drop()
        with self.cache._lock:
            self.cache.used += size
            self.cache.held[self.index] = self.path
            self.cache._busy.discard(self.index)

    def drop(self) -> None:
        self._batches = []
        if os.path.exists(self.part):
            os.remove(self.part)
        self.ok = False
        with self.cache._lock:
            self.cache._busy.discard(self.index)


class StreamShard(Counts):
    """This rank's row groups of one scanned DataFrame (the manifest's ``scans[name]``), read from
    their files with ``storage_options`` (the run's, ``sparktrain.storage.rank.options()``)."""

    def __init__(self, directory: str, name: str, manifest: dict, storage_options=None):
        from ..settings import rank as rank_settings
        from ..seam import worker_env

        super().__init__(name, manifest["rank"], manifest["rows"][name])
        entry = manifest["scans"][name]
        self.columns = list(entry["columns"])
        self.pieces = [Piece(**p) for p in entry["pieces"]]
        self._filter = _tree(entry.get("filter"))
        self._read_columns = list(entry.get("read") or self.columns)
        self._format = entry.get("format", "parquet")
        self._options = storage_options
        local_size = int(os.environ.get(worker_env.LOCAL_SIZE, "1"))
        limit = cache_limit(directory, local_size, rank_settings.current().data_cache_limit)
        self.cache = Cache(os.path.join(directory, f"{name}.cache"), limit)
        self._sample: Window | None = None
        self._whole: Window | None = None

    def sample(self) -> Window:
        """The first read of the first row group: the columns are checked, and the batches' shapes
        taken, on it."""
        if self._sample is None:
            self._sample = Window(self.name, [next(iter(self._read(0, keep=False)))], self.columns)
        return self._sample

    def epoch_windows(self, epoch: int, length: int, shuffle: bool, seed: int) -> Iterator[tuple[Window, np.ndarray]]:
        """``length`` rows for one epoch, as ``(rows held, positions in them)``: this shard's rows,
        each once before any twice, in an order drawn from ``(seed, rank, epoch)``."""
        rng = np.random.default_rng([seed, self.rank, epoch])
        if shuffle and len(self.cache.held) == len(self.pieces):
            whole = self._cached_whole()
            laps = -(-length // whole.held_rows)
            yield whole, np.concatenate([rng.permutation(whole.held_rows) for _ in range(laps)])[:length]
            return
        left = length
        while left > 0:
            order = rng.permutation(len(self.pieces)) if shuffle else range(len(self.pieces))
            for held in self._buffers(order):
                window = Window(self.name, _joined(held), self.columns)
                n = min(window.held_rows, left)
                yield window, rng.permutation(window.held_rows)[:n] if shuffle else np.arange(n)
                left -= n
                if left == 0:
                    return

    def _cached_whole(self) -> Window:
        if self._whole is None:
            pieces = [b for i in range(len(self.pieces)) for b in self.cache.batches(i)]
            self._whole = Window(self.name, pieces, self.columns)
        return self._whole

    def _buffers(self, order) -> Iterator[list]:
        """The epoch's reads in buffers to shuffle: the first of one read, so that the epoch's
        first batch waits for one read only, each next one twice as large, up to SHUFFLE_ROWS."""
        held, rows, fill = [], 0, READ_ROWS
        for index in order:
            for batch in self._read(index):
                held.append(batch)
                rows += batch.num_rows
                if rows >= fill:
                    yield held
                    held, rows, fill = [], 0, min(2 * fill, SHUFFLE_ROWS)
        if held:
            yield held

    def _read(self, index: int, keep: bool = True) -> Iterator:
        """Row group ``index``'s rows, from the cache where it holds them, else from its file (and
        into the cache, where it fits)."""
        if index in self.cache.held:
            yield from self.cache.batches(index)
            return
        piece = self.pieces[index]
        writer = self.cache.writer(index) if keep and self.cache.claim(index, piece) else None
        seen = 0
        try:
            for batch in self._from_file(piece):
                seen += batch.num_rows
                if seen > piece.rows:
                    break
                if writer is not None:
                    writer.write(batch)
                    if seen == piece.rows:  # whole: kept before its last rows go on (an epoch may end there)
                        writer.done()
                        writer = None
                yield batch
            if seen != piece.rows:
                raise SparkTrainError(
                    f"sparktrain.data: {piece.path} (row group {piece.row_group}) of the DataFrame fed as "
                    f"{self.name!r} holds {'more than ' if seen > piece.rows else ''}{seen} rows, where its "
                    f"footer said {piece.rows} when the run started: the table changed under the run")
        finally:
            if writer is not None:
                writer.drop()

    def _from_file(self, piece: Piece) -> Iterator:
        where = f"{piece.path}" + (f" row group {piece.row_group}" if piece.row_group >= 0 else "")
        try:
            reads = open_piece(piece, self._read_columns, self._format, READ_ROWS, self._options)
        except (OSError, ValueError) as e:
            raise SparkTrainError(f"sparktrain.data: could not open {piece.path} of the DataFrame fed as "
                                  f"{self.name!r}: {e}") from e
        with contextlib.closing(reads):
            while True:
                try:
                    batch = next(reads)
                except StopIteration:
                    return
                except (OSError, ValueError) as e:  # pyarrow's errors are OSError or ValueError kinds
                    raise SparkTrainError(f"sparktrain.data: could not read {where} of the DataFrame fed as "
                                          f"{self.name!r}: {e}") from e
                batch = rowfilter.apply(self._filter, batch, tuple(self.columns))
                if batch.num_rows:
                    yield batch


def _tree(value):
    """The filter as the manifest's JSON holds it (lists), as the tuples ``rowfilter`` reads."""
    if isinstance(value, list):
        return tuple(_tree(v) for v in value)
    return value


def _joined(batches: list) -> list:
    """The buffer's reads as one record batch: a gather from one piece is a plain numpy take."""
    import pyarrow as pa

    if len(batches) == 1:
        return batches
    return pa.Table.from_batches(batches).combine_chunks().to_batches(max_chunksize=None)


def concat(parts: list):
    """One structure of arrays from the structures each window built (``sparktrain.data.numpy``)."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(concat([p[i] for p in parts]) for i in range(len(first)))
    if not isinstance(first, np.ndarray):
        raise InvalidArgumentError(f"cannot join batches of {type(first).__name__}")
    return np.concatenate(parts)
