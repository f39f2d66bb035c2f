"""Gradient buckets: how a compiled step's gradients are split so that they travel while
backprop still computes the rest.

Backprop makes the gradients of the last layers first. Inside a ``tf.function`` the gradients
are put, in reverse order of their variables, into buckets of about ``bucket_bytes`` (the
setting ``SPARKTRAIN_BUCKET_BYTES``; a gradient larger than that is a bucket of its own), and
each bucket is one reduction (one engine call per dtype, as a fused reduction is) that the native
engine's TensorFlow kernels run on the engine's own thread (``native/reducer.h``): the kernel
returns at once, TensorFlow goes on computing, and only the ops that read a bucket's gradients
(the optimizer's updates of its variables) wait for that bucket. Every collective of a
``tf.function`` is a stateful op, which TensorFlow runs in program order, each after the one
before it has finished, so every rank hands the engine the same buckets in the same order.

The engine reduces each element of a buffer in rank order within a host, and two hosts' partial
sums commute, so a bucket's sums are bit for bit those of the one fused reduction, which still
runs eagerly, in TensorFlow 1 graphs and where ``bucket_bytes`` is 0.
"""
from __future__ import annotations

from ..engine.topology import split_buckets as split
from ..settings import rank as rank_settings


def _tf():
    import tensorflow as tf

    return tf


def compiled() -> bool:
    """Whether ops are being built into a ``tf.function`` (not run eagerly, not a TensorFlow 1 graph)."""
    tf = _tf()
    return not tf.executing_eagerly() and tf.compat.v1.get_default_graph().building_function


def nbytes(t) -> int | None:
    """The bytes of ``t`` when its shape is known where the step is built; None otherwise."""
    n = t.shape.num_elements()
    return None if n is None else n * t.dtype.size


def enabled() -> bool:
    """Whether gradients reduced here go in buckets: built into a ``tf.function``, ``bucket_bytes`` not 0."""
    return bool(rank_settings.current().bucket_bytes) and compiled()


def plan(tensors: list) -> list[list[int]] | None:
    """The buckets of ``tensors`` (dense gradients, in their variables' order) when :func:`enabled`;
    None: reduce them fused, as one."""
    if len(tensors) < 2 or not enabled():
        return None
    return split([nbytes(t) for t in tensors], rank_settings.current().bucket_bytes)


def label(number: int, count: int, nbytes_: int) -> str:
    """A bucket's name on the timeline."""
    return f"gradient bucket {number + 1}/{count} ({nbytes_ / (1 << 20):.2f} MiB)"
