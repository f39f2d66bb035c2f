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


def fused(tensors: list, collective) -> list:
    """Run ``collective`` once per dtype on one flat buffer of all ``tensors`` of that dtype, and
    return each tensor's part, reshaped. The dtypes go in name order, the same on every rank."""
    tf_ = tf()
    out: list = [None] * len(tensors)
    for idx in hostops.dtype_groups([t.dtype.name for t in tensors]):
        flat = tf_.concat([tf_.reshape(tensors[i], [-1]) for i in idx], axis=0)
        parts = tf_.split(collective(flat), [tf_.size(tensors[i]) for i in idx])
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
