"""What ``KerasModel.transform`` runs in Spark's Python workers: Arrow batches in, predictions
appended, Arrow batches out (``DataFrame.mapInArrow``), with no pandas on the way.

Each feature column arrives as an Arrow ``list<float>`` whose values are one contiguous buffer, so
the rows of a batch become one ``(rows, features)`` numpy array without a copy per row; the
predictions go back the same way, as one values buffer and its offsets. The model is loaded once
per Python worker process (Spark reuses its workers between tasks) and kept for the next task of
the same ``KerasModel`` object. ``predict_on_batch`` sees the same chunks of each Arrow batch as
``predict_batch_udf`` gave it (``batch_size`` rows at a time), so every row's prediction is the
same.
"""
from __future__ import annotations

import threading

from ..kerasline import KERAS_3

#: The models this worker process has loaded, by (url, Keras line): the latest few.
_models: dict = {}
_models_lock = threading.Lock()
_KEEP = 2


def cached_model(url: str, storage_options, custom_objects, line: str, token: str = ""):
    """The model at ``url``, loaded once per worker process for the ``KerasModel`` object whose
    ``token`` it is (see :func:`load`)."""
    key = (url, line, token)
    with _models_lock:
        model = _models.get(key)
        if model is None:
            model = load(url, storage_options, custom_objects, line)
            while len(_models) >= _KEEP:
                _models.pop(next(iter(_models)))
            _models[key] = model
        return model


def load(url: str, storage_options=None, custom_objects=None, line: str = KERAS_3):
    """The Keras model at ``url`` in the store, for prediction (not compiled), loaded by the Keras of
    ``line`` (``"keras"``: Keras 3; ``"tf_keras"``)."""
    import os
    import tempfile

    from .. import storage
    from ..host import tflog

    # TensorFlow's start-up lines (its import, and the first op's look for a GPU) are filtered as a
    # rank's are, without changing this process's environment: a driver's later runs in local mode,
    # whose ranks inherit it, keep their verbosity.
    quiet = tflog.filtered_stderr(tflog.level_from_env(unset=2))
    with quiet, tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        from .portable import load_file

        local = os.path.join(tmp, "model.keras")
        storage.get_file(url, local, storage_options)
        return load_file(local, custom_objects, line)


def list_to_numpy(column, shape, name: str):
    """An Arrow list column of equal-length rows as one numpy array of ``(rows, *shape)``."""
    import numpy as np
    import pyarrow as pa

    n = len(column)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise ValueError(f"feature column {name} has {column.null_count} null row(s) in this batch; drop or fill "
                         "them before transform")
    values = column.flatten()
    if values.null_count:
        raise ValueError(f"feature column {name} has null values inside its arrays; fill them before transform")
    flat = values.to_numpy(zero_copy_only=False)
    width = flat.size // n if n else 0
    if n and width * n != flat.size or (n and not np.all(np.diff(column.offsets.to_numpy()) == width)):
        raise ValueError(f"feature column {name}: rows of different lengths in one batch; every row must hold "
                         f"{width} values")
    dims = [d for d in shape]
    if dims and -1 not in dims and int(np.prod(dims)) == width:
        return flat.reshape((n, *dims))
    return flat.reshape((n, width))


def predictions_to_arrow(out, n: int, scalar: bool):
    """One output's predictions (``n`` rows) as an Arrow float column, or a ``list<float>`` one."""
    import numpy as np
    import pyarrow as pa

    out = np.asarray(out)
    if scalar:
        return pa.array(out.reshape(n).astype(np.float32, copy=False))
    flat = out.reshape(n, -1).astype(np.float32, copy=False)
    width = flat.shape[1]
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32)[:n + 1])
    return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1)))


class ArrowScorer:
    """``mapInArrow``'s function: every batch keeps its ``keep`` columns and gains one prediction
    column per model output (``out_cols``), from the feature columns ``features`` (one per model
    input) predicted ``batch_size`` rows at a time."""

    def __init__(self, url, storage_options, custom_objects, line, features, in_shapes, keep, out_cols, scalar,
                 batch_size: int, token: str = ""):
        self.url, self.storage_options, self.custom_objects, self.line = url, storage_options, custom_objects, line
        self.features, self.in_shapes, self.keep = list(features), list(in_shapes), list(keep)
        self.out_cols, self.scalar, self.batch_size = list(out_cols), list(scalar), int(batch_size)
        self.token = token

    def predict(self, model, xs: list) -> list:
        """Every output's predictions for ``xs``, in chunks of ``batch_size`` rows, concatenated."""
        import numpy as np

        n = len(xs[0])
        parts: list = [[] for _ in self.out_cols]
        for start in range(0, n, self.batch_size):
            chunk = [x[start:start + self.batch_size] for x in xs]
            outs = model.predict_on_batch(chunk if len(chunk) > 1 else chunk[0])
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            for p, o in zip(parts, outs):
                p.append(np.asarray(o))
        return [np.concatenate(p) if len(p) > 1 else p[0] for p in parts]

    def __call__(self, batches):
        import pyarrow as pa

        model = cached_model(self.url, self.storage_options, self.custom_objects, self.line, self.token)
        names = self.keep + self.out_cols
        for batch in batches:
            n = batch.num_rows
            columns = [batch.column(c) for c in self.keep]
            if n:
                xs = [list_to_numpy(batch.column(f), s, f) for f, s in zip(self.features, self.in_shapes)]
                outs = self.predict(model, xs)
                columns += [predictions_to_arrow(o, n, s) for o, s in zip(outs, self.scalar)]
            else:
                columns += [pa.array([], pa.float32() if s else pa.list_(pa.float32())) for s in self.scalar]
            yield pa.RecordBatch.from_arrays(columns, names=names)


class ColumnScorer(ArrowScorer):
    """A scalar Arrow UDF's function (``pyspark.sql.functions.arrow_udf``, pyspark 4.1 on): the
    feature columns of one Arrow batch in, one struct of the prediction columns out. Only the
    features cross to Python and only the predictions come back; the row's other columns stay in
    the JVM, which ``mapInArrow`` (:class:`ArrowScorer`) must send both ways."""

    def __call__(self, *arrays):
        import pyarrow as pa

        model = cached_model(self.url, self.storage_options, self.custom_objects, self.line, self.token)
        n = len(arrays[0])
        if n:
            xs = [list_to_numpy(a, s, f) for a, s, f in zip(arrays, self.in_shapes, self.features)]
            columns = [predictions_to_arrow(o, n, s) for o, s in zip(self.predict(model, xs), self.scalar)]
        else:
            columns = [pa.array([], pa.float32() if s else pa.list_(pa.float32())) for s in self.scalar]
        return pa.StructArray.from_arrays(columns, names=self.out_cols)
