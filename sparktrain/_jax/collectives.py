"""The native engine under Keras 3 on JAX: this process's communicator, and arrays reduced through it
from inside a compiled step, one fused buffer per dtype, or in gradient buckets.

A JAX rank of ``sparktrain.run(..., backend="jax")`` has the same env contract as a TensorFlow one
(the ring's addresses in ``TF_CONFIG``, the run's key), so :func:`start` makes the same
:class:`sparktrain.engine.Communicator`. Inside ``jax.jit`` the gradients of one dtype are
flattened and concatenated into one array, which the engine reduces in place (shared memory within
a host, the ring between hosts, encrypted where the run is): on CPU in an XLA FFI custom call
(``ffi``, no Python in the step), else, or where the handler cannot be built, in a
``jax.pure_callback`` on a host numpy copy. The step goes on with the result, split back into the
gradients.

Gradient buckets: where ``bucket_bytes`` (``SPARKTRAIN_BUCKET_BYTES``) is not 0 and the FFI handler
is in use, a traced reduction puts the arrays, last first (backprop makes the last layers'
gradients first), into buckets of about that many bytes, one engine call per dtype each. Each is
an asynchronous custom call: the handler hands the buffer to the engine's thread
(``native/reducer.h``) and returns a future, and XLA's thunk executor goes on with the thunks that
do not read the bucket. Each bucket's call also takes the one before it's result, which it does not
read: XLA orders custom calls by their data alone (``has_side_effect`` does not order them on CPU),
so this makes every rank hand the engine its buckets in program order, each once the one before it
is reduced. The engine reduces each element in rank order within a host, so the buckets' sums are
bit for bit those of the fused buffer. No TensorFlow is imported here.
"""
from __future__ import annotations

import threading

from .. import context
from ..engine.topology import dtype_groups, split_buckets
from ..errors import SparkTrainError
from ..settings import rank as rank_settings

_lock = threading.Lock()
_comm: list = []  # this process's communicator, once started


def start():
    """This process's communicator, made from the rank's env contract on the first call (every rank
    must call it: the ranks meet to make it) and made the process's current one, which the FFI
    handler (``ffi``) finds; the handler is built and registered here too, on CPU. Returns the
    communicator."""
    with _lock:
        if not _comm:
            from .. import engine

            comm = engine.from_env()
            comm.make_current()
            _comm.append(comm)
        comm = _comm[0]
    if _on_cpu():
        from . import ffi

        ffi.ready()
    return comm


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def communicator():
    """The communicator :func:`start` made, or a SparkTrainError naming ``init()``."""
    if not _comm:
        raise SparkTrainError("sparktrain's native engine is not running in this JAX process; call "
                              "sparktrain.keras.init() on every rank first (after shutdown(), init() again)")
    return _comm[0]


def stop() -> None:
    """Close the communicator, if one runs, after failing the buckets that wait for the engine's
    thread; :func:`start` makes a new one."""
    from . import ffi

    ffi.stop()
    with _lock:
        while _comm:
            _comm.pop().close()




def host_allreduce(op: str):
    """The host side of one fused collective: a function from a numpy buffer to its reduction over
    every rank with ``op``, on the communicator running when it is called (not when it was traced)."""
    import numpy as np

    def reduce(flat):
        out = np.array(flat, order="C", copy=True)  # the callback's argument is read-only
        communicator().allreduce_(out, op)
        return out

    return reduce


def fused_allreduce(arrays: list, op: str = "average", prescale: float = 1.0, postscale: float = 1.0,
                    wire_dtype=None) -> list:
    """``arrays`` (JAX arrays, traced or not) reduced over every rank with ``op``, as one engine call
    per dtype; each comes back in its own shape and dtype.

    Parameters
    ----------
    arrays : list
        The arrays; None stays None.
    op : str
        ``"average"`` or ``"sum"`` (or another of ``sparktrain.engine.OPS``).
    prescale, postscale : float
        Factors applied before and after the reduction (Horovod's ``gradient_predivide_factor``).
    wire_dtype : optional
        A floating dtype the floating arrays travel in (``float16`` for ``Compression.fp16``).

    Returns
    -------
    list
        The reduced arrays, in the order of ``arrays``.
    """
    import jax
    import jax.numpy as jnp

    out = list(arrays)
    present = [i for i, a in enumerate(arrays) if a is not None]
    if context.size() == 1 or not present:
        return [a if a is None or (prescale == postscale == 1.0) else a * (prescale * postscale) for a in arrays]
    sent = {}
    for i in present:
        a = arrays[i] if prescale == 1.0 else arrays[i] * prescale
        if wire_dtype is not None and jnp.issubdtype(a.dtype, jnp.floating):
            a = a.astype(wire_dtype)
        sent[i] = a
    buckets = _buckets(present, sent)
    after: list = []
    for idx in _engine_calls(present, sent, buckets):
        flat = jnp.concatenate([sent[i].reshape(-1) for i in idx]) if len(idx) > 1 else sent[idx[0]].reshape(-1)
        if buckets is None:
            reduced = _reduce_flat(flat, op)
        else:
            from .. import engine
            from . import ffi

            reduced = ffi.bucket(flat, engine.OPS.index(op), after)
            after = [reduced]
        offset = 0
        for i in idx:
            n = sent[i].size
            r = reduced[offset:offset + n].reshape(arrays[i].shape).astype(arrays[i].dtype)
            out[i] = r if postscale == 1.0 else r * postscale
            offset += n
    return out


def _buckets(present: list, sent: dict) -> list[list[int]] | None:
    """The gradient buckets of the arrays at ``present`` (positions into the arrays, each bucket in
    the order its call comes) where buckets are in use: ``bucket_bytes`` not 0, two arrays or more,
    traced, the FFI handler registered; None: one fused buffer per dtype."""
    import jax

    limit = rank_settings.current().bucket_bytes
    if not limit or len(present) < 2 or not isinstance(sent[present[0]], jax.core.Tracer) or not _on_cpu():
        return None
    from . import ffi

    if not ffi.ready():
        return None
    sizes = [sent[i].size * sent[i].dtype.itemsize for i in present]
    return [[present[k] for k in bucket] for bucket in split_buckets(sizes, limit)]


def _engine_calls(present: list, sent: dict, buckets: list | None) -> list[list[int]]:
    """The positions each engine call reduces, in the order the calls come: each bucket's (or, with
    no buckets, all the arrays') by dtype, the dtypes in name order."""
    out = []
    for bucket in [present] if buckets is None else buckets:
        out += [[bucket[k] for k in group] for group in dtype_groups([str(sent[i].dtype) for i in bucket])]
    return out


def _reduce_flat(flat, op: str):
    """One fused buffer reduced inside the step: in the FFI handler on CPU where it is registered,
    else through ``jax.pure_callback`` (on GPU too, where XLA's own collectives are the fast path)."""
    import jax

    if _on_cpu():
        from . import ffi

        if ffi.ready():
            from .. import engine

            return ffi.allreduce(flat, engine.OPS.index(op))
        if not ffi.turned_off():
            # A pure_callback's argument reaches the host through a transfer that XLA's CPU client can
            # queue behind the very step that waits in the callback, which can stall a small machine.
            raise SparkTrainError(f"sparktrain.keras.DistributedOptimizer on JAX (CPU) reduces in its XLA FFI "
                                  f"handler, which is not available here ({ffi.failure()}); install a C++ "
                                  f"compiler where the ranks run (or set CXX), or set {ffi.SWITCH_ENV}=0 to "
                                  "reduce through jax.pure_callback (slower, and it can stall on small machines)")
    return jax.pure_callback(host_allreduce(op), jax.ShapeDtypeStruct(flat.shape, flat.dtype), flat)


def broadcast_arrays(arrays: list, root: int) -> list:
    """Host numpy arrays as they are on ``root``: one engine call per dtype (in-place on a copy)."""
    import numpy as np

    arrays = [np.asarray(a) for a in arrays]
    if context.size() == 1 or not arrays:
        return arrays
    comm = communicator()
    out: list = [None] * len(arrays)
    for idx in dtype_groups([a.dtype.name for a in arrays]):
        flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
        flat = comm.broadcast(flat, root)
        offset = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
            offset += n
    return out


def average_floats(values: list[float]) -> list[float]:
    """Each of ``values`` averaged over every rank (float64, one engine call)."""
    import numpy as np

    if context.size() == 1:
        return [float(v) for v in values]
    return communicator().allreduce(np.asarray(values, np.float64), "average").tolist()


def gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, in rank order."""
    import numpy as np

    if context.size() == 1:
        return [int(value)]
    return [int(v) for v in communicator().allgather(np.asarray([value], np.int64))]
