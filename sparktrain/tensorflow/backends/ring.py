"""TensorFlow's own collective ops (``ringops``): its ring on CPU, NCCL on GPU."""
from __future__ import annotations

from .. import ops, ringops, timeline
from .base import Backend, fused, nbytes, tf


def _timed(kind: str, size: int, fn):
    """Run ``fn``; eagerly, also record it on the timeline."""
    if not (timeline.active() and tf().executing_eagerly()):
        return fn()
    start = timeline.now_us()
    out = fn()
    timeline.record(kind, size, start, timeline.now_us())
    return out


class Ring(Backend):
    def allreduce(self, t, op, name=None):
        return _timed(name or f"allreduce.{op}", nbytes(t), lambda: ringops.allreduce(t, op, name=name))

    def grouped_allreduce(self, tensors, op):
        if op == ops.Adasum:  # Horovod's Adasum is per tensor
            return [self.allreduce(t, op) for t in tensors]
        return fused(tensors, lambda flat: self.allreduce(flat, op))

    def allgather(self, t, name=None):
        return _timed(name or "allgather", nbytes(t), lambda: ringops.allgather(t, name=name))

    def broadcast(self, t, root_rank, name=None):
        return _timed(name or "broadcast", nbytes(t), lambda: ringops.broadcast(t, root_rank, name=name))

    def reducescatter(self, t, op, name=None):
        return _timed(name or f"reducescatter.{op}", nbytes(t), lambda: ringops.reducescatter(t, op, name=name))

    def alltoall(self, t, splits):
        return _timed("alltoall", nbytes(t), lambda: ringops.alltoall(t, splits))
