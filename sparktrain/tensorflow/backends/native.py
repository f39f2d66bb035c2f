"""The native engine's backends: ``Numpy`` (one ``tf.numpy_function`` calling ``hostops`` per
collective; in a TensorFlow 1 graph sequenced by ``sequence``) and ``Kernels`` (sparktrain's
TensorFlow kernels, which call the engine without Python and, in a TensorFlow 1 graph, are
sequenced by their own C++ sequencer; Adasum and any op the engine does not know go through
``Numpy``, except in a TensorFlow 1 graph, where they are refused)."""
from __future__ import annotations

from .. import hostops, ops, timeline
from ...engine import OPS as _ENGINE_OPS
from ...errors import InvalidArgumentError
from ..runtime import state
from . import sequence
from .base import Backend, in_graph, tf

#: The engine's op codes (``enum stc_op``), by op name; Adasum is not among them.
OP_CODES = {name: code for code, name in enumerate(_ENGINE_OPS)}


def _comm():
    """The native engine's communicator when the collective runs (not when it was traced: a
    function traced before shutdown() and init() runs on the new one)."""
    from ... import engine

    comm = state.comm
    if comm is None:
        raise engine.CollectiveError("sparktrain's native collective engine is not running in this process; "
                                     "call sparktrain.tensorflow.init() first (after shutdown(), init() again)",
                                     engine.BROKEN)
    return comm


def _call(kind: str, fn, inputs: list, tout, on=None):
    """Run ``fn`` (numpy in, numpy out) on the native engine as one op, eager or in a graph.

    ``on``: a process set's communicator (``backends.subset``: its ``comm()``, ``keys`` and
    ``sequencer``) where ``fn`` runs on it; None: the global one.

    Its failures surface as TensorFlow's own errors: a wait past the collective timeout as
    ``DeadlineExceededError``, a dead peer as ``UnavailableError``, ranks that disagree (and a
    broken communicator) as ``FailedPreconditionError`` (inside a graph TensorFlow wraps it
    in an ``UnknownError`` that names it; the kernels do not), each with the engine's message
    naming the ranks.
    """
    tf_ = tf()
    # In a TensorFlow 1 graph the ranks first agree on which op runs next (``sequence``).
    keys, sequencer, comm = (sequence, sequence.sequencer, _comm) if on is None else (on.keys, on.sequencer, on.comm)
    key = keys.key_for(tf_.compat.v1.get_default_graph()) if in_graph() else None

    def call(*arrays):
        from ... import engine

        start = timeline.now_us()
        try:
            out = fn(*arrays) if key is None else sequencer.run(comm(), key, fn, arrays, state.timeout)
        except sequence.StuckError as e:
            raise tf_.errors.DeadlineExceededError(None, None, str(e)) from None
        except engine.CollectiveError as e:
            cls = {engine.TIMEOUT: tf_.errors.DeadlineExceededError, engine.PEER: tf_.errors.UnavailableError,
                   engine.MISMATCH: tf_.errors.FailedPreconditionError,
                   engine.BROKEN: tf_.errors.FailedPreconditionError}.get(e.code, tf_.errors.InternalError)
            raise cls(None, None, str(e)) from None
        if timeline.active():
            timeline.record(kind, sum(a.nbytes for a in arrays), start, timeline.now_us())
        return out

    return tf_.numpy_function(call, inputs, tout, stateful=True)


def _rows_shape(t):
    return tf().TensorShape([None]).concatenate(t.shape[1:])


class Numpy(Backend):
    """Each collective as one ``tf.numpy_function`` calling ``hostops`` on every rank's
    communicator. ``backends.subset`` runs a process set's through the same methods, on the
    set's communicator (``_comm``, ``_run``, ``size``)."""

    #: The ranks a collective spans: None for every rank (``state.size`` when it is built).
    size = None

    def _comm(self):
        return _comm()

    def _run(self, kind: str, fn, inputs: list, tout):
        return _call(kind, fn, inputs, tout)

    def allreduce(self, t, op, name=None):
        out = self._run(name or f"allreduce.{op}", lambda a: hostops.allreduce(self._comm(), a, op), [t], t.dtype)
        out.set_shape(t.shape)
        return out

    def grouped_allreduce(self, tensors, op):
        outs = self._run(f"grouped_allreduce.{op}",
                         lambda *arrays: hostops.grouped_allreduce(self._comm(), list(arrays), op),
                         tensors, [t.dtype for t in tensors])
        if not isinstance(outs, (list, tuple)):  # TensorFlow unwraps a list of one
            outs = [outs]
        for o, t in zip(outs, tensors):
            o.set_shape(t.shape)
        return list(outs)

    def allgather(self, t, name=None):
        out = self._run(name or "allgather", lambda a: hostops.allgather(self._comm(), a), [t], t.dtype)
        out.set_shape(_rows_shape(t))
        return out

    def broadcast(self, t, root_rank, name=None):
        out = self._run(name or "broadcast", lambda a: hostops.broadcast(self._comm(), a, root_rank), [t], t.dtype)
        out.set_shape(t.shape)
        return out

    def reducescatter(self, t, op, name=None):
        out = self._run(name or f"reducescatter.{op}", lambda a: hostops.reducescatter(self._comm(), a, op), [t],
                        t.dtype)
        out.set_shape(_rows_shape(t))
        return out

    def alltoall(self, t, splits):
        out, received = self._run("alltoall", lambda a, s: hostops.alltoall(self._comm(), a, s), [t, splits],
                                  [t.dtype, tf().int32])
        out.set_shape(_rows_shape(t))
        received.set_shape([self.size or state.size])
        return out, received


class Kernels(Numpy):
    """Each collective as one of sparktrain's TensorFlow kernels (``tensorflow.kernels``); Adasum
    (which the kernels do not do) through ``Numpy``. In a TensorFlow 1 graph each kernel carries
    its ``sequence.key_for`` key and the kernels' own sequencer (``native/tf_sequencer.cc``) runs
    it in the order the ranks agree on; there ``Numpy``'s collectives, which have a sequencer of
    their own, are refused: the two would call the engine from two threads."""

    @staticmethod
    def _ops():
        from .. import kernels

        return kernels.ops()

    @staticmethod
    def _key() -> dict:
        """The ``sequence_key`` attribute: the op's key in a TensorFlow 1 graph, else -1."""
        if not in_graph():
            return {}
        return {"sequence_key": sequence.key_for(tf().compat.v1.get_default_graph())}

    @staticmethod
    def _not_in_graph(what: str) -> None:
        if in_graph():
            raise InvalidArgumentError(
                f"{what} in a TensorFlow 1 graph: sparktrain's TensorFlow kernels do not do it, and in a graph "
                "this rank runs only kernels. Build the step eagerly or with tf.function, or set "
                "SPARKTRAIN_TF_KERNELS=0 (every collective through tf.numpy_function) before init()")

    def allreduce(self, t, op, name=None):
        if op not in OP_CODES:
            self._not_in_graph(f"allreduce(op={ops.name_of(op)})")
            return super().allreduce(t, op, name)
        return self._ops().sparktrain_allreduce(t, reduce_op=OP_CODES[op], label=name or f"allreduce.{op}",
                                                **self._key())

    def grouped_allreduce(self, tensors, op, label=None, overlap=False):
        """One kernel (one engine call over one buffer) per dtype, the dtypes in name order, as
        ``hostops.grouped_allreduce`` does: the same calls, so ranks on either path agree.
        ``overlap``: each kernel reduces on the engine's thread (``native/reducer.h``) and
        TensorFlow's goes on at once."""
        if op not in OP_CODES:
            self._not_in_graph(f"grouped_allreduce(op={ops.name_of(op)})")
            return super().grouped_allreduce(tensors, op)
        k = self._ops()
        out: list = [None] * len(tensors)
        for idx in hostops.dtype_groups([t.dtype.name for t in tensors]):
            reduced = k.sparktrain_grouped_allreduce([tensors[i] for i in idx], reduce_op=OP_CODES[op],
                                                     label=label or f"grouped_allreduce.{op}", overlap=overlap,
                                                     **self._key())
            for i, r in zip(idx, reduced):
                out[i] = r
        return out

    def bucket_allreduce(self, tensors, op, label):
        return self.grouped_allreduce(tensors, op, label, overlap=not in_graph())

    def allgather(self, t, name=None):
        return self._ops().sparktrain_allgather(t, label=name or "allgather", **self._key())

    def broadcast(self, t, root_rank, name=None):
        return self._ops().sparktrain_broadcast(t, root=root_rank, label=name or "broadcast",
                                                **self._key())

    def reducescatter(self, t, op, name=None):
        if op not in OP_CODES:
            self._not_in_graph(f"reducescatter(op={ops.name_of(op)})")
            return super().reducescatter(t, op, name)
        return self._ops().sparktrain_reducescatter(t, reduce_op=OP_CODES[op], label=name or f"reducescatter.{op}",
                                                    **self._key())

    def alltoall(self, t, splits):
        out, received = self._ops().sparktrain_alltoall(t, splits, label="alltoall", **self._key())
        received.set_shape([state.size])
        return out, received
