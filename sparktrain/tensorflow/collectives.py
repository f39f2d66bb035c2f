"""Horovod's tensor collectives: allreduce, allgather, broadcast, reducescatter, alltoall, their
grouped forms, and the gradients TensorFlow takes through each.

On the native engine, allreduce (grouped: one engine call per dtype), broadcast, allgather,
reduce-scatter and alltoall are ops of sparktrain's own TensorFlow kernels (``kernels``:
compiled at first use, calling the engine without Python); Adasum, and every collective where
the kernels could not be built or ``SPARKTRAIN_TF_KERNELS=0``, are one ``tf.numpy_function``
calling ``hostops``. On TensorFlow's runtime, its collective ops (``ringops``). Either way they work eagerly and inside
``tf.function``. Every rank must issue the same collectives in the same order, as with Horovod;
on TensorFlow's runtime each call gets the next instance key from a per-process counter, fixed
when a ``tf.function`` is traced, so every rank must also trace the same functions in the same
order.

Gradients (``tf.custom_gradient``) follow Horovod's: allreduce's is an allreduce with the same
op and scale factors; allgather's is this rank's rows of an Average allreduce of the gradient;
broadcast's is an Average allreduce on the root and zeros elsewhere; reducescatter's is an
allgather (times the size for Sum, times the scale factors); alltoall's is an alltoall back
with the received splits.
"""
from __future__ import annotations

from typing import Iterable

from . import hostops, ops, ringops, runtime, timeline
from .compression import Compression
from .ops import Average, Sum
from .runtime import require_init, state
from ..errors import InvalidArgumentError

from ..engine import OPS as _ENGINE_OPS

#: The engine's op codes (``enum stc_op``), by op name; Adasum is not among them.
_OP_CODES = {name: code for code, name in enumerate(_ENGINE_OPS)}


def _tf():
    import tensorflow as tf

    return tf


class ProcessSet:
    """Horovod's process set, of which sparktrain has one: every rank (id 0)."""

    process_set_id = 0
    ranks = None

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def included(self) -> bool:
        return True

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise InvalidArgumentError(f"add_process_set({process_set!r}): sparktrain runs every collective over all ranks "
                               "and has no process sets besides global_process_set")


def remove_process_set(process_set):
    raise InvalidArgumentError(f"remove_process_set({process_set!r}): sparktrain has only global_process_set, "
                               "which cannot be removed")


def _check_process_set(process_set) -> None:
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return
    raise InvalidArgumentError(f"process_set={process_set!r}: sparktrain runs every collective over all ranks; "
                               "leave process_set at global_process_set")


# -- running one collective --------------------------------------------------------------------

def _native_call(kind: str, fn, inputs: list, tout):
    """Run ``fn`` (numpy in, numpy out) on the native engine as one op, eager or in a graph.

    Its failures surface as TensorFlow's own errors: a wait past the collective timeout as
    ``DeadlineExceededError``, a dead peer as ``UnavailableError``, ranks that disagree (and a
    broken communicator) as ``FailedPreconditionError`` (inside a graph TensorFlow wraps it
    in an ``UnknownError`` that names it; the kernels, see :func:`_kernel_ops`, do not), each with
    the engine's message naming the ranks.
    """
    tf = _tf()

    def call(*arrays):
        from .. import engine

        start = timeline.now_us()
        try:
            out = fn(*arrays)
        except engine.CollectiveError as e:
            cls = {engine.TIMEOUT: tf.errors.DeadlineExceededError, engine.PEER: tf.errors.UnavailableError,
                   engine.MISMATCH: tf.errors.FailedPreconditionError,
                   engine.BROKEN: tf.errors.FailedPreconditionError}.get(e.code, tf.errors.InternalError)
            raise cls(None, None, str(e)) from None
        if timeline.active():
            timeline.record(kind, sum(a.nbytes for a in arrays), start, timeline.now_us())
        return out

    return tf.numpy_function(call, inputs, tout, stateful=True)


def _ring_call(kind: str, nbytes, fn):
    """Run ``fn`` (TensorFlow's collective ops); eagerly, also record it on the timeline."""
    if not (timeline.active() and _tf().executing_eagerly()):
        return fn()
    start = timeline.now_us()
    out = fn()
    timeline.record(kind, nbytes, start, timeline.now_us())
    return out


def _nbytes(t) -> int:
    try:
        return int(t.shape.num_elements() or 0) * t.dtype.size
    except (TypeError, ValueError):
        return 0


def _native() -> bool:
    return state.comm is not None


def _comm():
    """The native engine's communicator when the collective runs (not when it was traced: a
    function traced before shutdown() and init() runs on the new one)."""
    from .. import engine

    comm = state.comm
    if comm is None:
        raise engine.CollectiveError("sparktrain's native collective engine is not running in this process; "
                                     "call sparktrain.tensorflow.init() first (after shutdown(), init() again)",
                                     engine.BROKEN)
    return comm


def _kernel_ops():
    """The kernels' op module where the native engine runs them (``kernels``), else None."""
    if not state.kernels:
        return None
    from . import kernels

    return kernels.ops()


def _scale(t, factor):
    if factor == 1.0:
        return t
    tf = _tf()
    if t.dtype.is_floating or t.dtype.is_complex:
        return t * tf.cast(factor, t.dtype)
    return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)  # integers: scaled, then truncated


def _differentiable(t) -> bool:
    return t.dtype.is_floating


def _check_root(root_rank) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < state.size:
        raise InvalidArgumentError(f"root_rank must be a rank in 0..{state.size - 1}, got {root_rank!r}")
    return root_rank


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

def _allreduce_raw(t, op: str, name=None):
    """The collective alone, no scaling, no gradient."""
    tf = _tf()
    if state.size == 1:
        return tf.identity(t)
    if _native():
        k = _kernel_ops()
        if k is not None and op in _OP_CODES:
            return k.sparktrain_allreduce(t, reduce_op=_OP_CODES[op], label=name or f"allreduce.{op}")
        out = _native_call(name or f"allreduce.{op}", lambda a: hostops.allreduce(_comm(), a, op), [t], t.dtype)
        out.set_shape(t.shape)
        return out
    return _ring_call(name or f"allreduce.{op}", _nbytes(t), lambda: ringops.allreduce(t, op, name=name))


def _allreduce(t, op: str, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Allreduce of a dense tensor with Horovod's scaling, and its gradient."""
    tf = _tf()

    def forward(x):
        return _scale(_allreduce_raw(_scale(x, prescale_factor), op, name), postscale_factor)

    if not _differentiable(t):
        return forward(t)

    @tf.custom_gradient
    def reduce(x):
        def grad(dy):
            return _allreduce(dy, op, prescale_factor, postscale_factor)

        return forward(x), grad

    return reduce(t)


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set=global_process_set, ignore_name_scope: bool = False):
    """Reduce ``tensor`` over all ranks with ``op`` (default ``Average``); Horovod's signature.

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
    _check_process_set(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor)
    tensor = _tensor(tensor, "allreduce")
    ops.check_dtype(tensor.dtype.name, op, "allreduce")
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name)
    return compression.decompress(reduced, ctx)


def _allreduce_sparse(slices, op: str, prescale_factor, postscale_factor):
    tf = _tf()
    if op not in (Sum, Average):
        raise InvalidArgumentError(f"allreduce of tf.IndexedSlices supports op=Sum or Average, got "
                                   f"{ops.name_of(op)}; pass sparse_as_dense=True (or tf.convert_to_tensor) "
                                   "to reduce it as a dense tensor")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise InvalidArgumentError("prescale_factor and postscale_factor do not apply to tf.IndexedSlices; reduce "
                                   "it as dense (sparse_as_dense=True) or scale it yourself")
    values = allgather(slices.values)
    indices = allgather(slices.indices)
    if op == Average:
        values = values / tf.cast(state.size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors: Iterable, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list:
    """Allreduce many tensors in as few collectives as possible (one per dtype); Horovod's signature.

    ``tf.IndexedSlices`` among them are reduced as sparse, as by :func:`allreduce`.
    """
    require_init()
    tf = _tf()
    tensors = list(tensors)
    op = ops.resolve(op, average)
    ops.check_scale(prescale_factor, postscale_factor)
    _check_process_set(process_set)
    if not tensors:
        return []
    out: list = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, op, prescale_factor, postscale_factor)
        else:
            dense_idx.append(i)
    if dense_idx:
        dense = [_tensor(tensors[i], "grouped_allreduce") for i in dense_idx]
        for t in dense:
            ops.check_dtype(t.dtype.name, op, "grouped_allreduce")
        packed = [compression.compress(t) for t in dense]
        reduced = _grouped_allreduce([p[0] for p in packed], op, prescale_factor, postscale_factor)
        for i, r, (_, ctx) in zip(dense_idx, reduced, packed):
            out[i] = compression.decompress(r, ctx)
    return out


def _grouped_allreduce(tensors: list, op: str, prescale_factor=1.0, postscale_factor=1.0) -> list:
    tf = _tf()

    def forward(*xs):
        xs = [_scale(x, prescale_factor) for x in xs]
        return [_scale(y, postscale_factor) for y in _grouped_raw(list(xs), op)]

    if not any(_differentiable(t) for t in tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def reduce(*xs):
        def grad(*dys):
            # TensorFlow may hand float32 zeros for a float64 output: reduce each in its own dtype.
            dys = [tf.cast(dy, x.dtype) for dy, x in zip(dys, xs)]
            back = _grouped_allreduce(dys, op, prescale_factor, postscale_factor)
            return [g if _differentiable(x) else None for g, x in zip(back, xs)]

        return forward(*xs), grad

    return list(reduce(*tensors))


def _grouped_raw(tensors: list, op: str) -> list:
    tf = _tf()
    if state.size == 1:
        return [tf.identity(t) for t in tensors]
    if _native():
        k = _kernel_ops()
        if k is not None and op in _OP_CODES:
            return _grouped_kernels(k, tensors, op)
        outs = _native_call(f"grouped_allreduce.{op}",
                            lambda *arrays: hostops.grouped_allreduce(_comm(), list(arrays), op),
                            tensors, [t.dtype for t in tensors])
        if not isinstance(outs, (list, tuple)):  # TensorFlow unwraps a list of one
            outs = [outs]
        for o, t in zip(outs, tensors):
            o.set_shape(t.shape)
        return list(outs)
    if op == ops.Adasum:  # Horovod's Adasum is per tensor
        return [_allreduce_raw(t, op) for t in tensors]
    return _fused(tensors, lambda flat: _allreduce_raw(flat, op))


def _grouped_kernels(k, tensors: list, op: str) -> list:
    """One kernel (one engine call over one buffer) per dtype, the dtypes in name order, as
    ``hostops.grouped_allreduce`` does: the same calls, so ranks on either path agree."""
    out: list = [None] * len(tensors)
    for idx in hostops.dtype_groups([t.dtype.name for t in tensors]):
        reduced = k.sparktrain_grouped_allreduce([tensors[i] for i in idx], reduce_op=_OP_CODES[op],
                                                 label=f"grouped_allreduce.{op}")
        for i, r in zip(idx, reduced):
            out[i] = r
    return out


def _fused(tensors: list, collective) -> list:
    """Run ``collective`` once per dtype on one flat buffer of all ``tensors`` of that dtype, and
    return each tensor's part, reshaped. The dtypes go in name order, the same on every rank."""
    tf = _tf()
    out: list = [None] * len(tensors)
    for idx in hostops.dtype_groups([t.dtype.name for t in tensors]):
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in idx], axis=0)
        parts = tf.split(collective(flat), [tf.size(tensors[i]) for i in idx])
        for i, part in zip(idx, parts):
            out[i] = tf.reshape(part, tf.shape(tensors[i]))
            out[i].set_shape(tensors[i].shape)
    return out


# -- allgather ---------------------------------------------------------------------------------

def _allgather_raw(t, name=None):
    tf = _tf()
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    if state.size == 1:
        return tf.identity(t)
    if _native():
        k = _kernel_ops()
        if k is not None:
            return k.sparktrain_allgather(t, label=name or "allgather")
        out = _native_call(name or "allgather", lambda a: hostops.allgather(_comm(), a), [t], t.dtype)
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        return out
    return _ring_call(name or "allgather", _nbytes(t), lambda: ringops.allgather(t, name=name))


def _allgather(t, name=None):
    tf = _tf()
    if not _differentiable(t):
        return _allgather_raw(t, name)

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            reduced = _allreduce(dy, Average)
            rows = tf.shape(x)[:1] if x.shape.rank else tf.constant([1])
            every = tf.reshape(_allgather_raw(rows), [state.size])
            mine = tf.split(reduced, every, axis=0)[state.rank] if state.size > 1 else reduced
            return tf.reshape(mine, tf.shape(x))

        return _allgather_raw(x, name), grad

    return gather(t)


def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False, process_set=global_process_set):
    """Concatenate ``tensor`` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks (even be 0); the others must match. A scalar
    gathers as a vector of one element per rank.
    """
    require_init()
    _check_process_set(process_set)
    tensor = _tensor(tensor, "allgather")
    ops.check_dtype(tensor.dtype.name, None, "allgather")
    return _allgather(tensor, name)


def grouped_allgather(tensors: Iterable, name: str | None = None, ignore_name_scope: bool = False,
                      process_set=global_process_set) -> list:
    """:func:`allgather` of each tensor, in order."""
    require_init()
    _check_process_set(process_set)
    tensors = [_tensor(t, "grouped_allgather") for t in tensors]
    for t in tensors:
        ops.check_dtype(t.dtype.name, None, "grouped_allgather")
    return [_allgather(t) for t in tensors]


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_raw(t, root_rank: int, name=None):
    tf = _tf()
    if state.size == 1:
        return tf.identity(t)
    if _native():
        k = _kernel_ops()
        if k is not None:
            return k.sparktrain_broadcast(t, root=root_rank, label=name or "broadcast")
        out = _native_call(name or "broadcast", lambda a: hostops.broadcast(_comm(), a, root_rank), [t], t.dtype)
        out.set_shape(t.shape)
        return out
    return _ring_call(name or "broadcast", _nbytes(t), lambda: ringops.broadcast(t, root_rank, name=name))


def _broadcast(t, root_rank: int, name=None):
    tf = _tf()
    if not _differentiable(t):
        return _broadcast_raw(t, root_rank, name)

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            reduced = _allreduce(dy, Average)
            return reduced if state.rank == root_rank else reduced * 0

        return _broadcast_raw(x, root_rank, name), grad

    return bcast(t)


def broadcast(tensor, root_rank: int = 0, name: str | None = None, ignore_name_scope: bool = False,
              process_set=global_process_set):
    """``tensor`` as it is on ``root_rank``, on every rank (same shape and dtype everywhere)."""
    require_init()
    _check_process_set(process_set)
    _check_root(root_rank)
    tensor = _tensor(tensor, "broadcast")
    ops.check_dtype(tensor.dtype.name, None, "broadcast")
    return _broadcast(tensor, root_rank, name)


def broadcast_variables(variables: Iterable, root_rank: int = 0, process_set=global_process_set,
                        inplace: bool = False) -> None:
    """Assign every variable the value it has on ``root_rank``, one broadcast per dtype.

    The assignment is always in place; ``inplace`` (Horovod's memory-saving variant) is accepted.
    """
    require_init()
    tf = _tf()
    _check_process_set(process_set)
    variables = list(variables)
    _check_root(root_rank)
    if state.size == 1 or not variables:
        return
    values = [tf.convert_to_tensor(v) for v in variables]  # Keras 3 variables report their dtype as a string
    for v, value in zip(variables, _fused(values, lambda flat: _broadcast_raw(flat, root_rank))):
        v.assign(value)


def broadcast_global_variables(root_rank: int = 0):
    """Horovod's TensorFlow 1 call, which has no global variables to find in TensorFlow 2's eager
    mode (Horovod refuses it there too): an error naming what to call instead."""
    raise InvalidArgumentError(f"broadcast_global_variables({root_rank!r}) needs TensorFlow 1 global variables; "
                               "call broadcast_variables(model.variables, root_rank) (or the Keras callback "
                               "BroadcastGlobalVariablesCallback) instead")


def broadcast_(variables, root_rank: int = 0, name: str | None = None, process_set=global_process_set):
    """Broadcast in place: every variable takes its value on ``root_rank``; returns their new
    values (tensors, in order; one tensor when given one variable), as Horovod's ``broadcast_``."""
    single = not isinstance(variables, (list, tuple))
    items = [variables] if single else list(variables)
    for v in items:
        if not hasattr(v, "assign"):
            raise InvalidArgumentError(f"broadcast_ assigns variables in place; got a {type(v).__name__}. Use "
                                       "broadcast() for tensors")
    broadcast_variables(items, root_rank, process_set=process_set)
    values = [_tf().convert_to_tensor(v) for v in items]
    return values[0] if single else values


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_raw(t, op: str, name=None):
    tf = _tf()
    if state.size == 1:
        return tf.identity(t)
    if _native():
        k = _kernel_ops()
        if k is not None and op in _OP_CODES:
            return k.sparktrain_reducescatter(t, reduce_op=_OP_CODES[op], label=name or f"reducescatter.{op}")
        out = _native_call(name or f"reducescatter.{op}", lambda a: hostops.reducescatter(_comm(), a, op), [t], t.dtype)
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        return out
    return _ring_call(name or f"reducescatter.{op}", _nbytes(t), lambda: ringops.reducescatter(t, op, name=name))


def _reducescatter(t, op: str, prescale_factor=1.0, postscale_factor=1.0, name=None):
    tf = _tf()

    def forward(x):
        return _scale(_reducescatter_raw(_scale(x, prescale_factor), op, name), postscale_factor)

    if not _differentiable(t):
        return forward(t)

    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            if op == Sum:
                dy = dy * tf.cast(state.size, dy.dtype)
            dy = _scale(_scale(dy, prescale_factor), postscale_factor)
            return _allgather(dy)

        return forward(x), grad

    return scatter(t)


def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average, name: str | None = None,
                  process_set=global_process_set, ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce ``tensor`` over all ranks, then keep this rank's rows of the result.

    The first dimension is split as evenly as possible, the first ``n % size`` ranks getting
    one row more, as Horovod does; ops Sum, Average, Min, Max and Product.
    """
    require_init()
    _check_process_set(process_set)
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
    return compression.decompress(_reducescatter(compressed, op, prescale_factor, postscale_factor, name), ctx)


def grouped_reducescatter(tensors: Iterable, device_dense: str = "", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor, in order."""
    return [reducescatter(t, device_dense, compression, op, process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]


# -- alltoall ----------------------------------------------------------------------------------

def _alltoall_raw(t, splits):
    tf = _tf()
    if state.size == 1:
        return tf.identity(t), tf.cast(tf.reshape(tf.shape(t)[:1], [1]), tf.int32)
    if _native():
        k = _kernel_ops()
        if k is not None:
            out, received = k.sparktrain_alltoall(t, splits, label="alltoall")
            received.set_shape([state.size])
            return out, received
        out, received = _native_call("alltoall", lambda a, s: hostops.alltoall(_comm(), a, s), [t, splits],
                                     [t.dtype, tf.int32])
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        received.set_shape([state.size])
        return out, received
    return _ring_call("alltoall", _nbytes(t), lambda: ringops.alltoall(t, splits))


def _alltoall(t, splits):
    tf = _tf()
    if not _differentiable(t):
        return _alltoall_raw(t, splits)

    @tf.custom_gradient
    def exchange(x):
        out, received = _alltoall_raw(x, splits)

        def grad(dy, _d_received=None):
            back, _ = _alltoall(dy, received)
            return back

        return (out, received), grad

    out, received = exchange(t)
    return out, received


def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
             process_set=global_process_set):
    """Send rows of ``tensor`` to every rank and receive theirs: returns ``(received,
    received_splits)`` as Horovod does.

    ``splits[k]`` rows (in order) go to rank ``k``; without ``splits`` the first dimension is
    split evenly (it must divide by the size). ``received`` holds the rows from rank 0, then
    rank 1, ...; ``received_splits[k]`` says how many came from rank ``k``. Rows may be 0.
    """
    require_init()
    tf = _tf()
    _check_process_set(process_set)
    tensor = _tensor(tensor, "alltoall")
    ops.check_dtype(tensor.dtype.name, None, "alltoall")
    if tensor.shape.rank == 0:
        raise InvalidArgumentError("alltoall sends rows of the first dimension and cannot take a scalar; reshape it "
                                   "to [1]")
    n = tensor.shape[0]
    if splits is None:
        if n is None:
            raise InvalidArgumentError("alltoall without splits needs a known first dimension; pass splits")
        if n % state.size:
            raise InvalidArgumentError(f"alltoall without splits splits the first dimension evenly, but {n} rows do "
                                       f"not divide by {state.size} ranks; pass splits (one count per rank)")
        splits = [n // state.size] * state.size
    splits = tf.convert_to_tensor(splits)
    if splits.dtype not in (tf.int32, tf.int64):
        raise InvalidArgumentError(f"alltoall splits must be int32 or int64 counts, got {splits.dtype.name}")
    splits = tf.cast(splits, tf.int32)
    static = tf.get_static_value(splits)
    if static is not None:
        bad = (static.ndim != 1 or static.shape[0] != state.size or (static < 0).any()
               or (n is not None and int(static.sum()) != n))
        if bad:
            raise InvalidArgumentError(f"alltoall splits must be {state.size} non-negative row counts (one per rank) "
                                       f"summing to the first dimension, {n}; got {static.tolist()}")
    return _alltoall(tensor, splits)


# -- synchronisation ---------------------------------------------------------------------------

def barrier(process_set=global_process_set) -> None:
    """Wait until every rank gets here."""
    require_init()
    _check_process_set(process_set)
    allreduce(_tf().constant(0, _tf().int32), op=Sum)


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
