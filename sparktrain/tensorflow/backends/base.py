"""What every collective backend offers (see the package's doc)."""
from __future__ import annotations

from .. import hostops


def tf():
    import tensorflow as tf

    return tf


def nbytes(t) -> int:
    try:
        return int(t.shape.num_elements() or 0) * t.dtype.size
    except (TypeError, ValueError):
        return 0


def in_graph() -> bool:
    """True while ops go into a TensorFlow 1 graph (``tf.compat.v1``), where nothing orders ops that
    do not depend on each other; eager ops run in program order, and ``tf.function`` orders its
    stateful ops (every collective is one) in program order too."""
    tf_ = tf()
    return not tf_.executing_eagerly() and not tf_.compat.v1.get_default_graph().building_function


def in_order(builders) -> list:
    """Build each collective in turn (``builders``: callables), each after the one before.

    Every rank must run its collectives in the same order. In a TensorFlow 1 graph, ops that do
    not depend on each other run in any order, even at once, and two collectives of the same
    shape would then meet their peers' other one: a wrong result, not an error. So there each is
    built with a control dependency on the one before."""
    out: list = []
    graph = in_graph()
    for build in builders:
        if graph and out:
            previous = [t.op for t in tf().nest.flatten(out[-1]) if hasattr(t, "op")]
            with tf().control_dependencies(previous):
                out.append(build())
        else:
            out.append(build())
    return out


def fused(tensors: list, collective) -> list:
    """Run ``collective`` once per dtype on one flat buffer of all ``tensors`` of that dtype, and
    return each tensor's part, reshaped. The dtypes go in name order, the same on every rank."""
    tf_ = tf()
    out: list = [None] * len(tensors)
    groups = hostops.dtype_groups([t.dtype.name for t in tensors])

    def one(idx):
        return lambda: collective(tf_.concat([tf_.reshape(tensors[i], [-1]) for i in idx], axis=0))

    for idx, reduced in zip(groups, in_order([one(idx) for idx in groups])):
        parts = tf_.split(reduced, [tf_.size(tensors[i]) for i in idx])
        for i, part in zip(idx, parts):
            out[i] = tf_.reshape(part, tf_.shape(tensors[i]))
            out[i].set_shape(tensors[i].shape)
    return out


class Backend:
    """The bare collectives of one backend. ``name`` labels the op (timeline, errors)."""

    def allreduce(self, t, op: str, name: str | None = None):
        raise NotImplementedError

    def grouped_allreduce(self, tensors: list, op: str) -> list:
        raise NotImplementedError

    def bucket_allreduce(self, tensors: list, op: str, label: str) -> list:
        """One gradient bucket of a compiled step (``tensorflow.buckets``): as ``grouped_allreduce``,
        the same engine calls; a backend that can reduces it off TensorFlow's thread while backprop
        goes on."""
        return self.grouped_allreduce(tensors, op)

    def allgather(self, t, name: str | None = None):
        """``t`` has at least one dimension (the caller reshapes a scalar)."""
        raise NotImplementedError

    def broadcast(self, t, root_rank: int, name: str | None = None):
        raise NotImplementedError

    def reducescatter(self, t, op: str, name: str | None = None):
        raise NotImplementedError

    def alltoall(self, t, splits):
        """``(received rows, rows received from each rank)``; ``splits`` is an int32 vector."""
        raise NotImplementedError
