"""Horovod's tensor collectives: allreduce, allgather, broadcast, reducescatter, alltoall, their
grouped forms, and the gradients TensorFlow takes through each.

On the native engine, allreduce (grouped: one engine call per dtype), broadcast, allgather,
reduce-scatter and alltoall are ops of sparktrain's own TensorFlow kernels (``kernels``:
compiled at first use, calling the engine without Python); Adasum, and every collective where
the kernels could not be built or ``SPARKTRAIN_TF_KERNELS=0``, are one ``tf.numpy_function``
calling ``hostops``; in a TensorFlow 1 graph both run in the order the ranks agree on. On
TensorFlow's runtime, its collective ops (``ringops``). Either way they work eagerly and inside
``tf.function``. Every rank must issue the same collectives in the same order, as with Horovod;
on TensorFlow's runtime each call gets the next instance key from a per-process counter, fixed
when a ``tf.function`` is traced, so every rank must also trace the same functions in the same
order.

Every collective takes Horovod's ``process_set=`` and runs over that set's ranks
(``process_sets``: ``_group`` says on which backend, over how many ranks, and this rank's index);
its gradient runs over the same set.

Gradients (``tf.custom_gradient``) follow Horovod's: allreduce's is an allreduce with the same
op and scale factors; allgather's is this rank's rows of an Average allreduce of the gradient;
broadcast's is an Average allreduce on the root and zeros elsewhere; reducescatter's is an
allgather (times the size for Sum, times the scale factors); alltoall's is an alltoall back
with the received splits.
"""
from __future__ import annotations

from typing import Iterable

from . import backends, ops
from .compression import Compression
from .ops import Average, Sum
from .process_sets import Group, global_process_set
from .process_sets import group as _group
from .runtime import require_init, state
from ..errors import InvalidArgumentError, UnsupportedError


def _tf():
    import tensorflow as tf

    return tf


# -- running one collective --------------------------------------------------------------------

def _backend(g: Group | None = None) -> backends.Backend:
    """Where this rank's collectives of ``g`` run: a process set's own backend (``process_sets``),
    or for every rank's, as ``init()`` chose (see ``backends``); TensorFlow's ring has no
    TensorFlow 1 graph path (the native engine's backends order such a graph's collectives)."""
    if g is not None and g.backend is not None:
        return g.backend
    if state.backend == "ring" and backends.in_graph():
        raise InvalidArgumentError(
            "this rank runs its collectives on TensorFlow's collective ring (NCCL on GPUs, or "
            "SPARKTRAIN_CPU_COLLECTIVES=tensorflow), whose ops do not run in a TensorFlow 1 graph session; build "
            "the step eagerly or with tf.function, or use the native engine on CPU "
            "(SPARKTRAIN_CPU_COLLECTIVES=native)")
    return backends.get(state.backend)


def _scale(t, factor):
    if factor == 1.0:
        return t
    tf = _tf()
    if t.dtype in (tf.float16, tf.bfloat16):  # as Horovod: scaled in float32, then rounded once
        return tf.cast(tf.cast(t, tf.float32) * factor, t.dtype)
    if t.dtype.is_floating or t.dtype.is_complex:
        # Made in t's dtype: tf.cast of a Python float would round it to float32 first.
        return t * tf.constant(factor, t.dtype)
    return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)  # integers: scaled, then truncated


def _differentiable(t) -> bool:
    return t.dtype.is_floating


def _check_root(root_rank, g: Group | None = None) -> int:
    """The root's index in ``g`` (default: every rank) of the global ``root_rank``, checked."""
    return (g or _group(None)).root(root_rank)


def _tensor(t, what: str):
    tf = _tf()
    if isinstance(t, tf.IndexedSlices):
        raise InvalidArgumentError(f"{what} takes dense tensors; convert the tf.IndexedSlices with "
                                   "tf.convert_to_tensor first")
    try:
        return tf.convert_to_tensor(t)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what} takes a tensor, got {type(t).__name__}: {e}") from None


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_raw(t, op: str, name=None, g=None):
    """The collective alone, no scaling, no gradient."""
    return _backend(g).allreduce(t, op, name)


def _allreduce(t, op: str, prescale_factor=1.0, postscale_factor=1.0, name=None, g=None):
    """Allreduce of a dense tensor with Horovod's scaling, and its gradient."""
    tf = _tf()

    def forward(x):
        return _scale(_allreduce_raw(_scale(x, prescale_factor), op, name, g), postscale_factor)

    if not _differentiable(t):
        return forward(t)

    @tf.custom_gradient
    def reduce(x):
        def grad(dy):
            return _allreduce(dy, op, prescale_factor, postscale_factor, g=g)

        return forward(x), grad

    return reduce(t)


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set=global_process_set, ignore_name_scope: bool = False):
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: all) with ``op`` (default
    ``Average``, over the set's size); Horovod's signature.

    The result is ``postscale_factor * op(prescale_factor * tensor)``. ``average=True/False`` is
    Horovod's deprecated spelling of ``op=Average/Sum`` (never both). A ``tf.IndexedSlices`` is
    reduced as sparse: its values and indices are allgathered (Average divides the values by
    the size), as Horovod does; only Sum and Average apply, without scale factors. Integer
    tensors averaged are divided with truncation toward zero. ``device_dense``/``device_sparse``
    and ``ignore_name_scope`` are accepted and change nothing: the engine chooses the device.
    """
    require_init()
    tf = _tf()
    op = ops.resolve(op, average)
    ops.check_scale(prescale_factor, postscale_factor)
    g = _group(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, g)
    tensor = _tensor(tensor, "allreduce")
    ops.check_dtype(tensor.dtype.name, op, "allreduce")
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name, g)
    return compression.decompress(reduced, ctx)


def _allreduce_sparse(slices, op: str, prescale_factor, postscale_factor, g: Group):
    tf = _tf()
    if op not in (Sum, Average):
        raise UnsupportedError(f"allreduce of tf.IndexedSlices supports op=Sum or Average, got "
                               f"{ops.name_of(op)}; pass sparse_as_dense=True (or tf.convert_to_tensor) "
                               "to reduce it as a dense tensor")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise UnsupportedError("prescale_factor and postscale_factor do not apply to tf.IndexedSlices; reduce "
                               "it as dense (sparse_as_dense=True) or scale it yourself")
    values, indices = backends.in_order([lambda: _allgather(_tensor(slices.values, "allreduce"), g=g),
                                         lambda: _allgather(_tensor(slices.indices, "allreduce"), g=g)])
    if op == Average:
        values = values / tf.cast(g.size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors: Iterable, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list:
    """Allreduce many tensors in as few collectives as possible (one per dtype); Horovod's signature.

    ``tf.IndexedSlices`` among them are reduced as sparse, as by :func:`allreduce`.
    """
    return reduce_group(tensors, ops.resolve(op, average), compression, prescale_factor, postscale_factor,
                        process_set)


def reduce_group(tensors: Iterable, op: str, compression=Compression.none, prescale_factor: float = 1.0,
                 postscale_factor: float = 1.0, process_set=global_process_set, bucket: str | None = None) -> list:
    """:func:`grouped_allreduce` with its op resolved; ``bucket`` (a gradient bucket's label,
    ``buckets``) reduces the dense tensors as one bucket of a compiled step: the same engine calls,
    run off TensorFlow's thread where the backend can."""
    require_init()
    tf = _tf()
    tensors = list(tensors)
    ops.check_scale(prescale_factor, postscale_factor)
    g = _group(process_set)
    if not tensors:
        return []
    out: list = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, op, prescale_factor, postscale_factor, g)
        else:
            dense_idx.append(i)
    if dense_idx:
        dense = [_tensor(tensors[i], "grouped_allreduce") for i in dense_idx]
        for t in dense:
            ops.check_dtype(t.dtype.name, op, "grouped_allreduce")
        packed = [compression.compress(t) for t in dense]
        reduced = _grouped_allreduce([p[0] for p in packed], op, prescale_factor, postscale_factor, g, bucket)
        for i, r, (_, ctx) in zip(dense_idx, reduced, packed):
            out[i] = compression.decompress(r, ctx)
    return out


def _grouped_allreduce(tensors: list, op: str, prescale_factor=1.0, postscale_factor=1.0, g=None,
                       bucket: str | None = None) -> list:
    tf = _tf()

    def forward(*xs):
        xs = [_scale(x, prescale_factor) for x in xs]
        backend = _backend(g)
        reduced = backend.grouped_allreduce(list(xs), op) if bucket is None else \
            backend.bucket_allreduce(list(xs), op, bucket)
        return [_scale(y, postscale_factor) for y in reduced]

    if not any(_differentiable(t) for t in tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def reduce(*xs):
        def grad(*dys):
            # TensorFlow may hand float32 zeros for a float64 output: reduce each in its own dtype.
            dys = [tf.cast(dy, x.dtype) for dy, x in zip(dys, xs)]
            back = _grouped_allreduce(dys, op, prescale_factor, postscale_factor, g, bucket)
            return [g if _differentiable(x) else None for g, x in zip(back, xs)]

        return forward(*xs), grad

    return list(reduce(*tensors))


# -- allgather ---------------------------------------------------------------------------------

def _allgather_raw(t, name=None, g=None):
    if t.shape.rank == 0:
        t = _tf().reshape(t, [1])
    return _backend(g).allgather(t, name)


def _allgather(t, name=None, g=None):
    tf = _tf()
    g = g or _group(None)
    if not _differentiable(t):
        return _allgather_raw(t, name, g)

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            rows = tf.shape(x)[:1] if x.shape.rank else tf.constant([1])
            reduced, every = backends.in_order([lambda: _allreduce(dy, Average, g=g),
                                                lambda: _allgather_raw(rows, g=g)])
            every = tf.reshape(every, [g.size])
            mine = tf.split(reduced, every, axis=0)[g.rank] if g.size > 1 else reduced
            return tf.reshape(mine, tf.shape(x))

        return _allgather_raw(x, name, g), grad

    return gather(t)


def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False, process_set=global_process_set):
    """Concatenate ``tensor`` from every rank of ``process_set`` along the first dimension, in rank order.

    The first dimension may differ between ranks (even be 0); the others must match. A scalar
    gathers as a vector of one element per rank.
    """
    require_init()
    g = _group(process_set)
    tensor = _tensor(tensor, "allgather")
    ops.check_dtype(tensor.dtype.name, None, "allgather")
    return _allgather(tensor, name, g)


def grouped_allgather(tensors: Iterable, name: str | None = None, ignore_name_scope: bool = False,
                      process_set=global_process_set) -> list:
    """:func:`allgather` of each tensor, in order."""
    require_init()
    g = _group(process_set)
    tensors = [_tensor(t, "grouped_allgather") for t in tensors]
    for t in tensors:
        ops.check_dtype(t.dtype.name, None, "grouped_allgather")
    return backends.in_order([lambda t=t: _allgather(t, g=g) for t in tensors])


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_raw(t, root: int, name=None, g=None):
    """``root``: the root's index in ``g`` (see :func:`_check_root`)."""
    return _backend(g).broadcast(t, root, name)


def _broadcast(t, root: int, name=None, g=None):
    tf = _tf()
    g = g or _group(None)
    if not _differentiable(t):
        return _broadcast_raw(t, root, name, g)

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            reduced = _allreduce(dy, Average, g=g)
            return reduced if g.rank == root else reduced * 0

        return _broadcast_raw(x, root, name, g), grad

    return bcast(t)


def broadcast(tensor, root_rank: int = 0, name: str | None = None, ignore_name_scope: bool = False,
              process_set=global_process_set):
    """``tensor`` as it is on ``root_rank``, on every rank of ``process_set`` (same shape and dtype
    everywhere). ``root_rank`` is a global rank, which must be in the set, as in Horovod."""
    require_init()
    g = _group(process_set)
    root = _check_root(root_rank, g)
    tensor = _tensor(tensor, "broadcast")
    ops.check_dtype(tensor.dtype.name, None, "broadcast")
    return _broadcast(tensor, root, name, g)


# -- synchronisation ---------------------------------------------------------------------------

def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of ``process_set`` gets here."""
    require_init()
    allreduce(_tf().constant(0, _tf().int32), op=Sum, process_set=process_set)


def join(device: str = "") -> int:
    """Wait until every rank has joined; returns the rank that joined last (an int32 tensor).

    Horovod's ``join`` lets a rank that ran out of data stop early while the others go on, its
    missing collectives filled with zeros. sparktrain's ranks must issue the same collectives
    (``sparktrain.data`` plans the same number of steps for every rank), so here ``join`` is a
    barrier that also says which rank arrived last, by each rank's wall clock: exact on one
    host, as good as the hosts' clocks agree across hosts.
    """
    require_init()
    tf = _tf()
    every = allgather(tf.reshape(tf.timestamp(), [1]))  # when it runs, eagerly or in a function
    return tf.cast(tf.argmax(every), tf.int32)
