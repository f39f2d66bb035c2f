"""Training data from a Spark DataFrame, inside ``train_fn``: ``run(..., data=df)`` feeds it.

On the driver::

    sparktrain.run(train, num_proc=3, data={"train": train_df, "val": val_df})   # or data=train_df

In ``train_fn``, each rank reads its own shard, which its barrier task spooled to the executor's
local disk (memory-mapped, so a rank's memory does not grow with its shard)::

    import sparktrain.data
    ds = sparktrain.data.dataset("features", label="label", batch_size=64, seed=7)
    val = sparktrain.data.dataset("features", label="label", batch_size=256, name="val", shuffle=False)
    model.fit(ds, validation_data=val, epochs=5, callbacks=[...])

Every rank yields the same number of batches per epoch (``ds.cardinality()``), whatever its
shard's size: a shorter shard wraps around (``uneven="wrap"``, the default, so every row is seen
every epoch) or every rank stops at the shortest shard (``uneven="drop"``). Rank 0 logs one line
that says which. See docs/dataframes.md.

On Keras' JAX backend (``run(..., backend="jax")``), :func:`pydataset` gives the same batches as a
``keras.utils.PyDataset``, without TensorFlow: each process's batch is its part of the global batch
under ``DataParallel(auto_shard_dataset=False)`` (docs/jax.md).
"""
from __future__ import annotations

import itertools
import sys
from typing import Any, Mapping, Sequence, Union

import numpy as np

from ..errors import InvalidArgumentError
from . import shaping
from .shard import UNEVEN, Shard, check_uneven
from .source import open_shard
from .stream import concat

__all__ = ["dataset", "pydataset", "numpy", "shard", "Shard", "UNEVEN"]

#: Bytes of rows the generator gathers per step, split into batches inside tf.data.
GATHER_BYTES = 4 << 20

#: A column, a list of scalar columns stacked side by side, or a dict of those (multi-input models).
Columns = Union[str, Sequence[str], Mapping[str, Union[str, Sequence[str]]]]


def shard(name: str = "train") -> Shard:
    """This rank's shard of the DataFrame fed as ``name``: its row counts and columns.

    >>> s = sparktrain.data.shard("train")                          # doctest: +SKIP
    >>> s.rows, s.rows_per_rank, s.steps_per_epoch(64)              # doctest: +SKIP
    (337, (337, 337, 337), 6)
    """
    return open_shard(name)


def dataset(features: Columns, label: Columns | None = None, *, batch_size: int, shuffle: bool = True,
            seed: int | None = None, name: str = "train", uneven: str = "wrap", prefetch: bool = True,
            sample_weight: str | None = None, model: Any = None):
    """A ``tf.data.Dataset`` of this rank's batches: ``(features, label)``, or features alone, or
    ``(features, label, sample_weight)``.

    Parameters
    ----------
    features, label : a column name (a tensor of ``[batch]`` for scalars, ``[batch, n]`` for
        fixed-length arrays and ml Vectors, bytes for binary and string columns); a list of
        scalar columns (stacked into ``[batch, len(list)]``); or a dict ``{input_name: column(s)}``
        for a model with several inputs.
    batch_size : rows per batch on this rank (the global batch is ``batch_size * size()``).
    shuffle : a new order every epoch, within this rank's shard. Each pass over the dataset is
        the next epoch.
    seed : the same seed gives the same order, epoch by epoch, in every run over the same data;
        None: a fresh one.
    name : which fed DataFrame (``data={"train": ..., "val": ...}``; a bare DataFrame is "train").
    uneven : "wrap" (default) or "drop"; see the module's docstring.
    prefetch : prefetch batches in the background (``tf.data.AUTOTUNE``).
    sample_weight : a numeric column of per-row weights, the third element of each batch, as
        ``model.fit`` takes it (needs ``label``).
    model : the Keras model the batches feed (either Keras line): each label is reshaped to its
        output's shape, as ``KerasEstimator`` does (``[batch]`` to ``[batch, 1]`` for an output of
        one value; a class id per row for an output of several classes stays ``[batch]``). A dict
        label is keyed by output name. None: labels as the table above says.

    Every batch has ``batch_size`` rows and ``cardinality()`` is the steps per epoch, the same
    on every rank.
    """
    import tensorflow as tf

    batch_size, seed, s, steps, make, (window, built) = _open(name, features, label, sample_weight, batch_size,
                                                              shuffle, seed, uneven, model)
    epochs = itertools.count()
    sample = built(np.arange(1))
    # Python hands tf.data several batches at a time (about GATHER_BYTES), which rebatch splits:
    # one generator step per batch would cost more than the gather itself for small rows.
    row_bytes = sum(a.nbytes if a.dtype != object else 1024 for a in tf.nest.flatten(sample))
    per_yield = max(1, min(steps, GATHER_BYTES // max(1, row_bytes * batch_size))) * batch_size

    def batches():
        for held, rows in s.epoch_windows(next(epochs), steps * batch_size, shuffle, seed):
            build = built if held is window else make(held)
            for start in range(0, len(rows), per_yield):
                yield build(rows[start:start + per_yield])

    signature = tf.nest.map_structure(lambda a: _spec(tf, a, None), sample)
    ds = tf.data.Dataset.from_generator(batches, output_signature=signature)
    # Yields hold any number of rows (a streamed window ends where its rows do); rebatch joins
    # and splits them into whole batches, and every epoch holds steps * batch_size rows.
    ds = ds.rebatch(batch_size, drop_remainder=True)
    ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
    return ds.prefetch(tf.data.AUTOTUNE) if prefetch else ds


def _open(name: str, features: Columns, label: Columns | None, sample_weight: str | None, batch_size: int,
          shuffle: bool, seed: int | None, uneven: str, model: Any = None):
    """What :func:`dataset` and :func:`pydataset` share: their arguments checked, this rank's shard
    of ``name`` opened, its steps per epoch, and ``make``, which gives the builder of batches from
    rows the shard holds (every column is checked on its first rows now; rank 0 says what it feeds).
    Returns ``(batch_size, seed, shard, steps, make, (sample rows, their builder))``."""
    batch_size = _check_batch_size(batch_size)
    check_uneven(uneven)
    if not isinstance(shuffle, bool):
        raise InvalidArgumentError(f"shuffle must be True or False, got {shuffle!r}")
    seed = _check_seed(seed)
    s = open_shard(name)
    steps = s.steps_per_epoch(batch_size, uneven)

    def make(held):
        return _builder(held, features, label, sample_weight, model)

    window = s.sample()
    built = make(window)
    if s.rank == 0:
        print(s.describe(batch_size, uneven), file=sys.stderr, flush=True)
    return batch_size, seed, s, steps, make, (window, built)


def pydataset(features: Columns, label: Columns | None = None, *, batch_size: int, shuffle: bool = True,
              seed: int | None = None, name: str = "train", uneven: str = "wrap", sample_weight: str | None = None,
              model: Any = None):
    """A ``keras.utils.PyDataset`` of this rank's batches, as :func:`dataset` gives them, for
    ``model.fit`` on any Keras backend; it needs no TensorFlow.

    Under ``keras.distribution.DataParallel(auto_shard_dataset=False)`` on JAX, each process's
    batch of ``batch_size`` rows is its part of a global batch of ``batch_size * size()`` rows,
    and every rank has ``len()`` batches per epoch. Each epoch (``on_epoch_end``) is shuffled anew.
    ``model=`` reshapes the labels to the model's outputs, as :func:`dataset`'s does.

    >>> ds = sparktrain.data.pydataset("features", label="label", batch_size=32, seed=7)  # doctest: +SKIP
    >>> model.fit(ds, epochs=5)                                                          # doctest: +SKIP
    """
    import keras

    batch_size, seed, s, steps, make, _ = _open(name, features, label, sample_weight, batch_size, shuffle, seed,
                                                uneven, model)

    class ShardBatches(keras.utils.PyDataset):
        """Batches in order: Keras asks for them one after another (and for the first once more,
        to see its shapes), and a streamed shard reads its rows in that order. A batch asked for
        out of order is the same batch: the epoch's reads are made again up to it."""

        def __init__(self):
            super().__init__()
            self.epoch = 0
            self._start()

        def _start(self) -> None:
            self._windows = s.epoch_windows(self.epoch, steps * batch_size, shuffle, seed)
            self._rows: list = []  # [builder, positions] of the window not yet batched
            self._next, self._last = 0, None

        def __len__(self) -> int:
            return steps

        def __getitem__(self, step: int):
            if self._last is not None and step == self._next - 1:
                return self._last
            if step < self._next:  # the epoch's order again from its start (it is drawn from the seed)
                self._start()
            while self._next < step:  # a batch asked for out of order: the ones before it are read past
                self._take(batch_size)
                self._next += 1
            self._last = self._take(batch_size)
            self._next += 1
            return self._last

        def _take(self, n: int):
            parts = []
            while n:
                if not self._rows or not len(self._rows[1]):
                    held, rows = next(self._windows)
                    self._rows = [make(held), rows]
                build, rows = self._rows
                part = rows[:n]
                parts.append(build(part))
                n -= len(part)
                self._rows = [build, rows[len(part):]]
            return parts[0] if len(parts) == 1 else concat(parts)

        def on_epoch_end(self) -> None:
            self.epoch += 1
            self._start()

    return ShardBatches()


def numpy(features: Columns, label: Columns | None = None, name: str = "train", *, uneven: str = "wrap",
          model: Any = None):
    """This rank's shard as numpy arrays, in the DataFrame's order: ``(x, y)``, or ``x`` alone.

    For data that fits in memory and ``model.fit(x, y, batch_size=...)``. Every rank gets as many
    rows as the longest shard (``uneven="wrap"``: a shorter shard repeats its first rows) or the
    shortest (``"drop"``), so ``fit`` runs the same number of steps on every rank. ``model=``
    reshapes the labels to the model's outputs, as :func:`dataset`'s does.
    """
    check_uneven(uneven)
    s = open_shard(name)
    length = max(s.rows_per_rank) if uneven == "wrap" else min(s.rows_per_rank)
    window = s.sample()
    built = _builder(window, features, label, None, model)  # every column checked before a row is read
    parts = [(built if held is window else _builder(held, features, label, None, model))(rows)
             for held, rows in s.epoch_windows(0, length, False, 0)]
    return parts[0] if len(parts) == 1 else concat(parts)


def _builder(s: Shard, features: Columns, label: Columns | None, sample_weight: str | None = None, model: Any = None):
    """A function from file positions to the batch's structure of arrays; checks every column now."""
    take_x = _taker(s, features, "features")
    if model is not None and label is None:
        raise InvalidArgumentError("model= shapes the labels to the model's outputs: pass label= too, or leave "
                                   "model out")
    if label is not None:
        take = _taker(s, label, "label")
        take_y = take if model is None else _shaped(take, shaping.label_shaper(model, label))
    if sample_weight is not None:
        if label is None or not isinstance(sample_weight, str):
            raise InvalidArgumentError(f"sample_weight={sample_weight!r}: name one numeric column, and pass a label too")
        take_w = _taker(s, [sample_weight], "sample_weight")
        return lambda rows: (take_x(rows), take_y(rows), take_w(rows)[:, 0])
    if label is None:
        return take_x
    return lambda rows: (take_x(rows), take_y(rows))


def _shaped(take, shaper):
    return lambda rows: shaper(take(rows))


def _taker(s: Shard, spec: Columns, what: str):
    if isinstance(spec, str):
        column = s.column(spec)
        return column.take
    if isinstance(spec, Mapping):
        if not spec:
            raise InvalidArgumentError(f"{what} is an empty dict; name at least one input")
        parts = {str(k): _taker(s, v, f"{what}[{k!r}]") for k, v in spec.items()}
        return lambda rows: {k: take(rows) for k, take in parts.items()}
    if isinstance(spec, Sequence) and spec and all(isinstance(c, str) for c in spec):
        columns = [s.column(c) for c in spec]
        wide = [c.name for c in columns if c.row_shape or c.bytes_like]
        if wide:
            raise InvalidArgumentError(
                f"{what} stacks scalar numeric columns only; {wide} hold arrays or bytes. Pass such a column "
                "alone, or a dict of inputs")
        dtype = np.result_type(*(c.dtype for c in columns))
        return lambda rows: np.stack([c.take(rows).astype(dtype, copy=False) for c in columns], axis=1)
    raise InvalidArgumentError(
        f"{what} must be a column name, a list of column names or a dict of them, got {spec!r}")


def _spec(tf, array: np.ndarray, batch_size: int | None):
    dtype = tf.string if array.dtype == object else tf.as_dtype(array.dtype)
    return tf.TensorSpec((batch_size,) + array.shape[1:], dtype)


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int (rows per batch on each rank), "
                                   f"got {batch_size!r}")
    return int(batch_size)


def _check_seed(seed: Any) -> int:
    if seed is None:
        return int(np.random.SeedSequence().entropy % (1 << 63))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidArgumentError(f"seed must be a non-negative int or None, got {seed!r}")
    return int(seed)
