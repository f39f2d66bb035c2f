"""TensorFlow collectives across the ranks of ``sparktrain.run``: Horovod's ``horovod.tensorflow``.

Inside ``train_fn``::

    import sparktrain.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([hvd.rank()]), op=hvd.Sum)

On GPU the collectives are TensorFlow's own (``CollectiveReduceV2`` and friends) over NCCL. On
CPU they run on sparktrain's native engine (``sparktrain.native``: shared memory within a host,
a TCP ring between hosts), called through one ``tf.numpy_function`` per collective, so they
work eagerly and inside ``model.fit``'s compiled step alike. ``SPARKTRAIN_CPU_COLLECTIVES`` /
``spark.sparktrain.cpuCollectives=tensorflow`` chooses TensorFlow's gRPC ring instead, as does
a build without the engine (with one warning). ``init`` brings the chosen runtime up from the
``TF_CONFIG`` that ``run`` wrote; :func:`collective_engine` says which it is.
Every rank must issue the same collectives in the same order, as with Horovod; each call gets
the next instance key from a per-process counter, so the keys agree across ranks. Inside a
``tf.function`` the key is fixed when the function is traced, as MultiWorkerMirroredStrategy
does, so every rank must trace the same functions in the same order.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Iterable

from .. import context as _ctx
from .. import settings
from ..errors import SparkTrainError

Average = "average"
Sum = "sum"

#: Default seconds a collective may wait for its peers before failing (DeadlineExceeded).
DEFAULT_TIMEOUT = settings.SETTINGS["collective_timeout"].default
COLLECTIVE_TIMEOUT_ENV = settings.SETTINGS["collective_timeout"].env

# Keys far from the ones MultiWorkerMirroredStrategy hands out for its own collectives.
_GROUP_KEY = 0x5A17
_FIRST_INSTANCE_KEY = 1 << 20


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.initialized = False
        self.size = 1
        self.rank = 0
        self.gpu = False
        self.timeout = DEFAULT_TIMEOUT
        self.strategy = None
        self.next_key = _FIRST_INSTANCE_KEY
        #: "native", "tensorflow" or "nccl"; the native engine's communicator when native.
        self.engine = None
        self.comm = None


_state = _State()


def _tf():
    import tensorflow as tf

    return tf


def init(timeout: float | None = None) -> None:
    """Bring up the collective runtime among the ranks. Idempotent; call it first in ``train_fn``.

    Parameters
    ----------
    timeout : seconds a collective may wait for the other ranks before it fails, so that a rank
        that died or hangs never blocks the others for ever. Default: ``SPARKTRAIN_COLLECTIVE_TIMEOUT``
        or 600.

    On GPU, the rank sees exactly the one GPU ``run`` pinned for it (``CUDA_VISIBLE_DEVICES``) and
    memory growth is turned on, so TensorFlow does not take all of its memory up front.
    """
    with _state.lock:
        if _state.initialized:
            return
        timeout = settings.resolve("collective_timeout", timeout)
        tf = _tf()
        gpus = tf.config.list_physical_devices("GPU")
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        _state.gpu = bool(gpus)
        _state.size = _ctx.size()
        _state.rank = _ctx.rank()
        _state.timeout = float(timeout)
        _state.engine = "nccl" if _state.gpu else _cpu_engine()
        if _state.size > 1 and _state.engine == "native":
            from .. import native

            _state.comm = native.from_env(_state.timeout)
        elif _state.size > 1:
            if "TF_CONFIG" not in os.environ:
                raise SparkTrainError("TF_CONFIG is not set: sparktrain.tensorflow.init() must run inside sparktrain.run")
            # Constructing the strategy is TensorFlow's supported way to start this process's
            # server from TF_CONFIG and configure the collective runtime (NCCL or ring). Keras 3
            # models are not placed under its scope: the collectives below are issued directly.
            _configure_health_checks(_state.timeout)
            impl = (tf.distribute.experimental.CommunicationImplementation.NCCL if _state.gpu
                    else tf.distribute.experimental.CommunicationImplementation.RING)
            # No timeout_seconds here: TensorFlow starts a thread per collective call that
            # sleeps out the timeout, so a per-step timeout piles up thousands of threads
            # (measured: 6,700 per process after 468 tf_keras steps, then a crash).
            options = tf.distribute.experimental.CommunicationOptions(implementation=impl)
            _state.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        _state.initialized = True


def _cpu_engine() -> str:
    """The CPU engine the settings ask for, or TensorFlow's ring (with one warning) where the
    native engine is not available."""
    wanted = settings.resolve("cpu_collectives")
    if wanted == "tensorflow":
        return "tensorflow"
    from .. import native

    if native.available():
        return "native"
    logging.getLogger(__name__).warning("%s; using TensorFlow's ring for collectives on CPU instead",
                                        native.unavailable_reason())
    return "tensorflow"


def collective_engine() -> str:
    """Which engine runs this rank's collectives: ``"native"``, ``"tensorflow"`` or ``"nccl"``.

    >>> hvd.init(); hvd.collective_engine()  # doctest: +SKIP
    'native'
    """
    _require_init()
    return _state.engine


def _native_call(fn, inputs: list, tout: list):
    """Run ``fn`` (numpy in, numpy out) on the native engine as one op, eager or in a graph.

    Its failures surface as TensorFlow's own errors, as with TensorFlow's runtime: a wait past
    the collective timeout as ``DeadlineExceededError``, a dead peer as ``UnavailableError``,
    ranks that disagree as ``InvalidArgumentError`` (inside a graph TensorFlow wraps them in an
    ``UnknownError`` that names them), each with the engine's message naming the rank.
    """
    tf = _tf()

    def call(*arrays):
        from .. import native

        try:
            return fn(*arrays)
        except native.CollectiveError as e:
            kind = {native.TIMEOUT: tf.errors.DeadlineExceededError, native.PEER: tf.errors.UnavailableError,
                    native.MISMATCH: tf.errors.InvalidArgumentError,
                    native.BROKEN: tf.errors.FailedPreconditionError}.get(e.code, tf.errors.InternalError)
            raise kind(None, None, str(e)) from None

    return tf.numpy_function(call, inputs, tout, stateful=True)


def _check_native_dtype(dtype) -> None:
    if dtype.name not in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        raise SparkTrainError(f"allreduce on CPU takes float16, bfloat16, float32, float64, int32 or int64 tensors; "
                              f"got {dtype.name}")


def _configure_health_checks(timeout: float) -> None:
    """Make the runtime's peer health check notice a dead or frozen rank within about ``timeout``.

    The strategy pings every peer on a background thread and aborts all collectives when one
    stops answering; that is what bounds collectives inside ``tf.function`` (see ``_timeout``).
    """
    try:
        from tensorflow.python.distribute import collective_all_reduce_strategy as cars

        ext = cars.CollectiveAllReduceExtended
        # Three attempts of check_timeout each, every interval: detection within ~timeout.
        ext._check_health_timeout = max(1, int(timeout / 6))
        ext._check_health_interval = max(1, int(timeout / 2))
        ext._check_health_initial_timeout = max(1, int(timeout))  # every rank must reach init() by then
    except (ImportError, AttributeError):  # a TensorFlow without these knobs keeps its defaults
        pass


def _timeout() -> float:
    """The per-op timeout: the collective timeout when eager, none inside ``tf.function``.

    TensorFlow implements an op's timeout with a thread that sleeps it out, one per call; per
    training step that leaks threads until the process dies. Inside functions (every training
    step) the runtime's health check bounds the wait instead.
    """
    return _state.timeout if _tf().executing_eagerly() else 0.0


def _require_init() -> None:
    if not _state.initialized:
        raise SparkTrainError("call sparktrain.tensorflow.init() (or sparktrain.keras.init()) first")


def rank() -> int:
    """This process's rank."""
    return _ctx.rank()


def size() -> int:
    """The number of ranks."""
    return _ctx.size()


def local_rank() -> int:
    """This process's index among the ranks on its host."""
    return _ctx.local_rank()


def local_size() -> int:
    """The number of ranks on this host."""
    return _ctx.local_size()


def is_initialized() -> bool:
    return _state.initialized


def strategy():
    """A MultiWorkerMirroredStrategy wired from the run's env, for tf_keras (``TF_USE_LEGACY_KERAS=1``).

    Keras 3 does not support this strategy (``model.fit`` fails with "Attempt to convert a value
    (PerReplica...)"); use ``sparktrain.keras.DistributedOptimizer`` there. Under the strategy,
    tf_keras runs collectives inside ``model.save`` too, so every rank must call it.
    """
    init()
    if _state.strategy is None:
        _state.strategy = _tf().distribute.MultiWorkerMirroredStrategy()
    return _state.strategy


# -- collectives -------------------------------------------------------------------------------

def _next_key() -> int:
    with _state.lock:
        key = _state.next_key
        _state.next_key += 1
    return key


def _hint() -> str:
    return "nccl" if _state.gpu else "ring"


def check_op(op: str) -> str:
    """``op`` if it is a reduction sparktrain runs (``Average`` or ``Sum``); otherwise an error naming it."""
    if op not in (Average, Sum):
        raise SparkTrainError(f"op must be sparktrain.tensorflow.Average or Sum, got {op!r}")
    return op


def allreduce(tensor, op: str = Average, name: str | None = None):
    """Reduce ``tensor`` over all ranks: the mean (``Average``, default) or the sum (``Sum``).

    Integer tensors averaged are divided with integer division, as TensorFlow's collectives do.
    """
    _require_init()
    tf = _tf()
    check_op(op)
    tensor = tf.convert_to_tensor(tensor)
    if _state.size == 1:
        return tf.identity(tensor)
    if _state.comm is not None:
        _check_native_dtype(tensor.dtype)
        comm = _state.comm
        out = _native_call(lambda x: comm.allreduce(x, op), [tensor], tensor.dtype)
        out.set_shape(tensor.shape)
        return out
    final = "Div" if op == Average else "Id"
    return tf.raw_ops.CollectiveReduceV2(
        input=tensor, group_size=_state.size, group_key=_GROUP_KEY, instance_key=_next_key(),
        ordering_token=[], merge_op="Add", final_op=final, communication_hint=_hint(),
        timeout_seconds=_timeout(), name=name)


def grouped_allreduce(tensors: Iterable, op: str = Average) -> list:
    """Allreduce many tensors in as few collectives as possible: one per dtype.

    The tensors of each dtype are flattened into one buffer, reduced once, and split back.
    """
    _require_init()
    tf = _tf()
    check_op(op)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if _state.size == 1:
        return [tf.identity(t) for t in tensors]
    if _state.comm is not None:
        return _native_grouped(tensors, op)
    return _fused(tensors, lambda flat: allreduce(flat, op=op))


def _native_grouped(tensors: list, op: str) -> list:
    """One op for the whole list: inside it, one engine call per dtype on one flat buffer."""
    tf = _tf()
    for t in tensors:
        _check_native_dtype(t.dtype)
    comm = _state.comm

    def reduce_all(*arrays):
        import numpy as np

        out: list = [None] * len(arrays)
        by_dtype: dict = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype.name, []).append(i)
        for name in sorted(by_dtype):  # the same order on every rank
            idx = by_dtype[name]
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx]) if len(idx) > 1 else \
                np.array(arrays[idx[0]].reshape(-1))  # never write into an input: TensorFlow owns it
            comm.allreduce_(flat, op)
            offset = 0
            for i in idx:
                n = arrays[i].size
                out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
                offset += n
        return out

    outs = _native_call(reduce_all, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return list(outs)


def _fused(tensors: list, collective: Callable[[Any], Any]) -> list:
    """Run ``collective`` once per dtype on one flat buffer of all ``tensors`` of that dtype, and
    return each tensor's part, reshaped. The dtypes go in name order, the same on every rank."""
    tf = _tf()
    out: list[Any] = [None] * len(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        idx = by_dtype[dtype]
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in idx], axis=0)
        parts = tf.split(collective(flat), [tf.size(tensors[i]) for i in idx])
        for i, part in zip(idx, parts):
            out[i] = tf.reshape(part, tf.shape(tensors[i]))
    return out


def allgather(tensor, name: str | None = None):
    """Concatenate ``tensor`` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks; the other dimensions must match.
    """
    _require_init()
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    if _state.size == 1:
        return tf.identity(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    if _state.comm is not None:
        comm = _state.comm
        out = _native_call(comm.allgather, [tensor], tensor.dtype)
        out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return out
    # Gather every rank's length, pad to the longest, gather, then cut the padding out.
    n = tf.shape(tensor, out_type=tf.int64)[:1]
    lengths = _gather(n)
    longest = tf.reduce_max(lengths)
    pad = tf.concat([[[0, longest - n[0]]], tf.zeros([tf.rank(tensor) - 1, 2], tf.int64)], axis=0)
    gathered = _gather(tf.pad(tensor, pad), name=name)
    mask = tf.sequence_mask(lengths, longest)
    return tf.boolean_mask(tf.reshape(gathered, tf.concat([[_state.size, longest], tf.shape(tensor, out_type=tf.int64)[1:]], 0)),
                           mask)


def _gather(tensor, name=None):
    tf = _tf()
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=_state.size, group_key=_GROUP_KEY, instance_key=_next_key(),
        ordering_token=[], communication_hint=_hint(), timeout_seconds=_timeout(), name=name)


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """``tensor`` as it is on ``root_rank``, on every rank (same shape and dtype everywhere)."""
    _require_init()
    tf = _tf()
    _check_root(root_rank)
    tensor = tf.convert_to_tensor(tensor)
    if _state.size == 1:
        return tf.identity(tensor)
    if _state.comm is not None:
        comm = _state.comm
        out = _native_call(lambda x: comm.broadcast(x, root_rank), [tensor], tensor.dtype)
        out.set_shape(tensor.shape)
        return out
    common = dict(group_size=_state.size, group_key=_GROUP_KEY, instance_key=_next_key(),
                  communication_hint=_hint(), timeout_seconds=_timeout(), name=name)
    if _ctx.rank() == root_rank:
        return tf.raw_ops.CollectiveBcastSendV2(input=tensor, **common)
    return tf.raw_ops.CollectiveBcastRecvV2(T=tensor.dtype, shape=tf.shape(tensor), **common)


def _check_root(root_rank: int) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < _state.size:
        raise SparkTrainError(f"root_rank must be a rank in 0..{_state.size - 1}, got {root_rank!r}")


def broadcast_variables(variables: Iterable, root_rank: int = 0) -> None:
    """Assign every variable the value it has on ``root_rank``, one broadcast per dtype."""
    _require_init()
    tf = _tf()
    variables = list(variables)
    if _state.size == 1 or not variables:
        return
    _check_root(root_rank)
    values = [tf.convert_to_tensor(v) for v in variables]  # Keras 3 variables report their dtype as a string
    for v, value in zip(variables, _fused(values, lambda flat: broadcast(flat, root_rank))):
        v.assign(value)


def barrier() -> None:
    """Wait until every rank gets here (a tiny allreduce)."""
    allreduce(_tf().constant(0, _tf().int32), op=Sum)


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape`` so ``gradient()`` returns gradients averaged over all ranks.

    Example
    -------
    >>> with tf.GradientTape() as tape:            # doctest: +SKIP
    ...     loss = loss_fn(y, model(x, training=True))
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, tape, op: str = Average):
        self._tape = tape
        self._op = check_op(op)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        return average_gradients(grads, self._op)


def average_gradients(grads, op: str = Average):
    """Allreduce a (possibly nested) list of gradients in fused collectives; None stays None."""
    tf = _tf()
    flat = tf.nest.flatten(grads, expand_composites=False)
    present = [i for i, g in enumerate(flat) if g is not None]
    dense = [tf.convert_to_tensor(flat[i]) for i in present]  # IndexedSlices become dense
    reduced = grouped_allreduce(dense, op=op) if dense else []
    out = list(flat)
    for i, r in zip(present, reduced):
        out[i] = r
    return tf.nest.pack_sequence_as(grads, out)
