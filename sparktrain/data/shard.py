"""This rank's share of a fed DataFrame, read memory-mapped from the spool, and the epoch plan.

No TensorFlow here: :class:`Shard` gives numpy arrays; ``sparktrain.data.dataset`` wraps them in
``tf.data``. The plan that keeps every rank in step lives in :meth:`Shard.steps_per_epoch` and
:meth:`Shard.epoch_rows`: every rank knows every rank's row count (exchanged at the rendezvous,
see :mod:`sparktrain.data.layout`), so every rank computes the same number of steps by itself.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from . import layout

#: How a rank whose shard is shorter than another's keeps step with it.
UNEVEN = ("wrap", "drop")


class Column:
    """One column of a shard, gathered by row position without reading the rest of the file."""

    def __init__(self, name: str, pieces: Sequence, starts: np.ndarray):
        self.name = name
        self.starts = starts
        self.views = [self._view(p) for p in pieces]
        self.bytes_like = bool(self.views) and not isinstance(self.views[0], np.ndarray)
        shapes = {v.shape[1:] for v in self.views if isinstance(v, np.ndarray) and len(v)}
        if len(shapes) > 1:
            raise InvalidArgumentError(
                f"column {name!r} holds arrays of different lengths {sorted(s[0] for s in shapes)}; "
                "sparktrain feeds fixed-length arrays only (pad or truncate them in Spark)")
        self.row_shape: tuple[int, ...] = shapes.pop() if shapes else (0,) * (self._rank() - 1)
        self.dtype = np.dtype(object) if self.bytes_like else (self.views[0].dtype if self.views else np.float32)

    def _rank(self) -> int:
        return self.views[0].ndim if self.views and isinstance(self.views[0], np.ndarray) else 1

    def _view(self, piece):
        import pyarrow as pa
        import pyarrow.compute as pc

        if piece.null_count:
            raise InvalidArgumentError(
                f"column {self.name!r} has {piece.null_count} null value(s); fill or drop them in Spark "
                f"(df.fillna(...) or df.dropna(subset=[{self.name!r}]))")
        kind = piece.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            lengths = pc.list_value_length(piece)
            low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if low != high:
                raise InvalidArgumentError(
                    f"column {self.name!r} holds arrays of lengths {low} to {high}; sparktrain feeds "
                    "fixed-length arrays only (pad or truncate them in Spark)")
            values = piece.flatten()
            if values.null_count:
                raise InvalidArgumentError(f"column {self.name!r} has null elements inside its arrays; fill them "
                                           "in Spark first")
            return _numpy(values).reshape(len(piece), low or 0)
        if pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_binary(kind) \
                or pa.types.is_large_string(kind):
            return piece  # gathered with Arrow's take, as Python bytes/str
        return _numpy(piece)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The rows at these file positions, in this order."""
        if len(self.views) == 1:
            return self._take_one(0, positions)
        piece = np.searchsorted(self.starts, positions, side="right") - 1
        order = np.argsort(piece, kind="stable")  # the positions grouped by piece, one take per piece
        bounds = np.searchsorted(piece[order], np.arange(len(self.views) + 1))
        out = np.empty((len(positions),) + self.row_shape, self.dtype)
        for p in range(len(self.views)):
            where = order[bounds[p]:bounds[p + 1]]
            if len(where):
                out[where] = self._take_one(p, positions[where] - self.starts[p])
        return out

    def _take_one(self, p: int, local: np.ndarray) -> np.ndarray:
        view = self.views[p]
        if isinstance(view, np.ndarray):
            return view[local]
        return view.take(local).to_numpy(zero_copy_only=False)


def _numpy(array) -> np.ndarray:
    try:
        return array.to_numpy(zero_copy_only=True)  # a view of the memory-mapped file
    except Exception:  # noqa: BLE001 - booleans are bit-packed: those are copied, a piece at a time
        return array.to_numpy(zero_copy_only=False)


class Counts:
    """What every kind of shard knows before it reads a row: every rank's row count of one named
    DataFrame, and from it the steps every rank runs per epoch.

    Attributes: ``name``; ``rank``; ``rows`` (this rank's); ``rows_per_rank`` (every rank's, in
    rank order); ``total_rows``; ``columns`` (names, as in the DataFrame).
    """

    columns: list[str]

    def __init__(self, name: str, rank: int, rows_per_rank: Sequence[int]):
        self.name = name
        self.rank = int(rank)
        self.rows_per_rank: tuple[int, ...] = tuple(int(r) for r in rows_per_rank)
        self.rows = self.rows_per_rank[self.rank]
        self.total_rows = sum(self.rows_per_rank)
        if self.total_rows == 0:
            raise InvalidArgumentError(f"the DataFrame fed as {name!r} has no rows; there is nothing to train on")
        if self.rows == 0:
            raise InvalidArgumentError(
                f"the DataFrame fed as {name!r} has {self.total_rows} row(s), fewer than the "
                f"{len(self.rows_per_rank)} ranks, so rank {self.rank} got none; every rank needs at least one row")

    def steps_per_epoch(self, batch_size: int, uneven: str = "wrap") -> int:
        """Batches every rank yields per epoch: the longest shard's count with ``"wrap"`` (shorter
        shards wrap around, so every row is seen every epoch), the shortest's with ``"drop"``."""
        check_uneven(uneven)
        if uneven == "wrap":
            return max(math.ceil(rows / batch_size) for rows in self.rows_per_rank)
        steps = min(self.rows_per_rank) // batch_size
        if steps == 0:
            raise InvalidArgumentError(
                f"uneven='drop' keeps every rank to the shortest shard of {self.name!r}, "
                f"{min(self.rows_per_rank)} rows, which is less than one batch of {batch_size}; use a smaller "
                "batch_size or uneven='wrap'")
        return steps

    def describe(self, batch_size: int, uneven: str) -> str:
        steps = self.steps_per_epoch(batch_size, uneven)
        counts = "/".join(str(r) for r in self.rows_per_rank)
        head = f"sparktrain.data: {self.name!r} rank shards {counts} rows"
        if uneven == "drop":
            left = sum(r - steps * batch_size for r in self.rows_per_rank)
            return (f"{head}; every rank stops at the shortest shard: {steps} steps per epoch of {batch_size}, "
                    f"{left} rows left out each epoch")
        if len(set(self.rows_per_rank)) > 1 or self.rows_per_rank[0] % batch_size:
            return f"{head}; wrapping to {steps} steps per epoch of {batch_size} on every rank"
        return f"{head}; {steps} steps per epoch of {batch_size} on every rank"


class Pieces:
    """Rows held as Arrow record batches (memory-mapped or in memory), gathered by position."""

    name: str

    def _hold(self, pieces: Sequence, columns: Sequence[str]) -> None:
        self._pieces = list(pieces)
        self.columns = [c for c in columns if c != layout.ROW_COLUMN]
        lengths = np.array([b.num_rows for b in self._pieces], np.int64)
        self.held_rows = int(lengths.sum())
        self._starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._columns: dict[str, Column] = {}

    def column(self, name: str) -> Column:
        if name not in self._columns:
            if name not in self.columns:
                raise InvalidArgumentError(
                    f"the DataFrame fed as {self.name!r} has no column {name!r}; it has {self.columns}")
            self._columns[name] = Column(name, [b.column(name) for b in self._pieces], self._starts)
        return self._columns[name]


class Window(Pieces):
    """Some rows of a streamed shard (``sparktrain.data.stream``), held while they are batched."""

    def __init__(self, name: str, pieces: Sequence, columns: Sequence[str]):
        self.name = name
        self._hold(pieces, columns)


class Shard(Counts, Pieces):
    """This rank's rows of one named DataFrame, spooled by its task and read memory-mapped."""

    def __init__(self, directory: str, name: str, manifest: dict | None = None):
        import pyarrow as pa

        manifest = manifest if manifest is not None else read_manifest(directory, name)
        super().__init__(name, manifest["rank"], manifest["rows"][name])
        path = os.path.join(directory, layout.spool_file(name))
        reader = pa.ipc.open_file(pa.memory_map(path, "r"))
        pieces = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        self._hold(pieces, pieces[0].schema.names)
        ids = np.concatenate([_numpy(b.column(layout.ROW_COLUMN)) for b in self._pieces])
        # The shuffle delivers rows in any order; the row ids (taken before it) fix one.
        self._canonical = np.argsort(ids, kind="stable")

    def sample(self) -> "Shard":
        """Rows to check the columns against and to take the batches' shapes from: all of them."""
        return self

    def epoch_windows(self, epoch: int, length: int, shuffle: bool, seed: int):
        """The epoch as ``(rows held, positions in them)``: here one, the whole shard."""
        yield self, self.epoch_rows(epoch, length, shuffle, seed)

    def epoch_rows(self, epoch: int, length: int, shuffle: bool, seed: int) -> np.ndarray:
        """``length`` file positions for one epoch: this shard's rows, each once before any twice.

        Shuffled within the shard by ``(seed, rank, epoch)``, so every epoch differs and every
        run with the same seed repeats; a short shard continues with a fresh permutation.
        """
        if not shuffle:
            order = np.resize(np.arange(self.rows), length)
        else:
            rng = np.random.default_rng([seed, self.rank, epoch])
            laps = math.ceil(length / self.rows)
            order = np.concatenate([rng.permutation(self.rows) for _ in range(laps)])[:length]
        return self._canonical[order]


def check_uneven(uneven: str) -> None:
    if uneven not in UNEVEN:
        raise InvalidArgumentError(f"uneven must be 'wrap' (short shards wrap around) or 'drop' (stop at the "
                                   f"shortest shard), got {uneven!r}")


def read_manifest(directory: str, name: str) -> dict:
    """The spool directory's manifest, refusing a name the run was not fed."""
    manifest = layout.read_manifest(directory)
    if name not in manifest["rows"]:
        raise InvalidArgumentError(
            f"no DataFrame named {name!r} was fed to this run; it has {sorted(manifest['rows'])}. Pass "
            f"data={{{name!r}: df, ...}} to sparktrain.run")
    return manifest
