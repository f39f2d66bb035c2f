"""Horovod's collectives that split rows between ranks: reducescatter (each rank keeps its rows of
the reduced tensor) and alltoall (each rank sends rows to every other). See ``collectives`` for
what all collectives share: the backend, the checks, the scale factors and the gradients."""
from __future__ import annotations

from typing import Iterable

from . import backends, ops
from .collectives import _allgather, _backend, _differentiable, _group, _scale, _tensor, _tf, global_process_set
from .compression import Compression
from .ops import Average, Sum
from .runtime import require_init
from ..errors import InvalidArgumentError

_split_error_class = None


def __getattr__(name: str):
    if name == "SplitsError":  # built at first use, so that pickles of one find it by name
        return _split_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _split_error() -> type:
    """``SplitsError``: alltoall's refusal of splits that do not match the rows, both sparktrain's
    ``InvalidArgumentError`` and TensorFlow's ``tf.errors.InvalidArgumentError``, which Horovod's
    alltoall op raises there."""
    global _split_error_class
    if _split_error_class is None:
        tf_error = _tf().errors.InvalidArgumentError

        class SplitsError(InvalidArgumentError, tf_error):
            def __init__(self, message: str):
                tf_error.__init__(self, None, None, message)
                self.args = (message,)

            def __str__(self) -> str:
                return self.message

        SplitsError.__module__, SplitsError.__qualname__ = __name__, "SplitsError"
        _split_error_class = SplitsError
    return _split_error_class


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter(t, op: str, prescale_factor=1.0, postscale_factor=1.0, name=None, g=None):
    tf = _tf()
    g = g or _group(None)

    def forward(x):
        return _scale(_backend(g).reducescatter(_scale(x, prescale_factor), op, name), postscale_factor)

    if not _differentiable(t):
        return forward(t)

    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            if op == Sum:
                dy = dy * tf.cast(g.size, dy.dtype)
            dy = _scale(_scale(dy, prescale_factor), postscale_factor)
            return _allgather(dy, g=g)

        return forward(x), grad

    return scatter(t)


def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average, name: str | None = None,
                  process_set=global_process_set, ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: all), then keep this rank's
    rows of the result (split over the set's size).

    The first dimension is split as evenly as possible, the first ``n % size`` ranks getting
    one row more, as Horovod does; ops Sum, Average, Min, Max and Product.
    """
    require_init()
    g = _group(process_set)
    ops.check_scale(prescale_factor, postscale_factor)
    op = ops.check_op(op)
    if op == ops.Adasum:
        raise InvalidArgumentError("reducescatter does not support op=Adasum; use Sum or Average")
    tensor = _tensor(tensor, "reducescatter")
    if tensor.shape.rank == 0:
        raise InvalidArgumentError("reducescatter splits the first dimension and cannot take a scalar; reshape it "
                                   "to [1] or use allreduce")
    ops.check_dtype(tensor.dtype.name, op, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_reducescatter(compressed, op, prescale_factor, postscale_factor, name, g), ctx)


def grouped_reducescatter(tensors: Iterable, device_dense: str = "", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor, in order."""
    return backends.in_order([lambda t=t: reducescatter(t, device_dense, compression, op, process_set=process_set,
                                                        prescale_factor=prescale_factor,
                                                        postscale_factor=postscale_factor) for t in tensors])


# -- alltoall ----------------------------------------------------------------------------------

def _alltoall(t, splits, g):
    tf = _tf()
    if not _differentiable(t):
        return _backend(g).alltoall(t, splits)

    @tf.custom_gradient
    def exchange(x):
        out, received = _backend(g).alltoall(x, splits)

        def grad(dy, _d_received=None):
            back, _ = _alltoall(dy, received, g)
            return back

        return (out, received), grad

    out, received = exchange(t)
    return out, received


def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
             process_set=global_process_set):
    """Send rows of ``tensor`` to every rank of ``process_set`` (default: all) and receive theirs,
    as Horovod does: returns
    ``(received, received_splits)`` when given ``splits``, else ``received`` alone.

    ``splits[k]`` rows (in order) go to rank ``k``; without ``splits`` the first dimension is
    split evenly (it must divide by the size). ``received`` holds the rows from rank 0, then
    rank 1, ...; ``received_splits[k]`` says how many came from rank ``k``. Rows may be 0. In a
    process set, ``k`` counts the set's ranks (its index in ``process_set.ranks``).
    """
    require_init()
    tf = _tf()
    g = _group(process_set)
    size = g.size
    tensor = _tensor(tensor, "alltoall")
    ops.check_dtype(tensor.dtype.name, None, "alltoall")
    if tensor.shape.rank == 0:
        raise InvalidArgumentError("alltoall sends rows of the first dimension and cannot take a scalar; reshape it "
                                   "to [1]")
    n = tensor.shape[0]
    if splits is None:
        if n is None:  # known when the step runs: checked then, each rank getting an equal share
            rows = tf.shape(tensor, out_type=tf.int32)[0]
            check = tf.debugging.assert_equal(
                rows % size, 0, message=f"alltoall without splits splits the first dimension evenly over {size} "
                f"ranks; these rows do not divide by {size}: pass splits (one count per rank)")
            with tf.control_dependencies([check]):
                return _alltoall(tensor, tf.fill([size], rows // size), g)[0]
        if n % size:
            raise _split_error()(f"alltoall without splits splits the first dimension evenly, but {n} rows do "
                                 f"not divide by {size} ranks; pass splits (one count per rank)")
        return _alltoall(tensor, tf.constant([n // size] * size, tf.int32), g)[0]
    splits = tf.convert_to_tensor(splits)
    if splits.dtype not in (tf.int32, tf.int64):
        raise InvalidArgumentError(f"alltoall splits must be int32 or int64 counts, got {splits.dtype.name}")
    splits = tf.cast(splits, tf.int32)
    static = tf.get_static_value(splits)
    if static is not None:
        bad = (static.ndim != 1 or static.shape[0] != size or (static < 0).any()
               or (n is not None and int(static.sum()) != n))
        if bad:
            raise _split_error()(f"alltoall splits must be {size} non-negative row counts (one per rank) "
                                 f"summing to the first dimension, {n}; got {static.tolist()}")
    return _alltoall(tensor, splits, g)
