"""The collectives on TensorFlow's own runtime (``CollectiveReduceV2`` and friends): the gRPC
ring on CPU, NCCL on GPU.

TensorFlow's collectives take fewer dtypes than Horovod's: the rest travel widened (8- and
16-bit integers and bool as int32; bfloat16, and float16 on CPU, as float32) and come back
narrowed to their own dtype, exactly for every value they can hold.

Reducescatter and alltoall: on GPU they are TensorFlow's NCCL ``CollectiveReduceScatterV2`` and
``CollectiveAllToAllV2``. Those split rows evenly only, where Horovod's reducescatter gives the
first ``n % size`` ranks one row more and alltoall takes ragged splits, so the rows are first laid
out in equal blocks, one per rank, padded with zeros (``padded_blocks``), and the padding is cut
off the result. On CPU they are built on allreduce and allgather: TensorFlow has no CPU
implementation of the two ops (TensorFlow 2.21: "CollectiveRegistry::Lookup did not find
collective implementation").
"""
from __future__ import annotations

from . import runtime
from .runtime import GROUP_KEY, state

_MERGE = {"sum": "Add", "average": "Add", "min": "Min", "max": "Max", "product": "Mul"}
_NATIVE_TF = ("float32", "float64", "int32", "int64")


def _tf():
    import tensorflow as tf

    return tf


def _hint() -> str:
    return "nccl" if state.gpu else "ring"


def _wide(dtype):
    """The dtype ``dtype`` travels as on TensorFlow's collectives."""
    tf = _tf()
    if dtype.name in _NATIVE_TF or (dtype.name == "float16" and state.gpu):
        return dtype
    return tf.float32 if dtype.is_floating else tf.int32


def _widen(t):
    wide = _wide(t.dtype)
    return t if wide == t.dtype else _tf().cast(t, wide)


def _narrow(t, dtype):
    tf = _tf()
    if t.dtype == dtype:
        return t
    if dtype == tf.bool:
        return tf.not_equal(t, 0)
    return tf.cast(t, dtype)  # integers wrap as the engine's own sums do


def allreduce(tensor, op: str, name=None):
    tf = _tf()
    if op == "adasum":
        stack = tf.reshape(allgather(tf.expand_dims(tensor, 0)), tf.concat([[state.size], tf.shape(tensor)], 0))
        return _adasum_tf(stack, tensor.dtype)
    wide = _widen(tensor)
    out = tf.raw_ops.CollectiveReduceV2(
        input=wide, group_size=state.size, group_key=GROUP_KEY, instance_key=runtime.next_key(),
        ordering_token=[], merge_op=_MERGE[op], final_op="Div" if op == "average" else "Id",
        communication_hint=_hint(), timeout_seconds=runtime.op_timeout(), name=name)
    return _narrow(out, tensor.dtype)


def _adasum_tf(stack, dtype):
    """Adasum over ranks on axis 0 of ``stack``, in float64 (see ``hostops.adasum``)."""
    tf = _tf()
    level = [tf.cast(stack[r], tf.float64) for r in range(state.size)]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            a, b = level[i], level[i + 1]
            dot, na, nb = tf.reduce_sum(a * b), tf.reduce_sum(a * a), tf.reduce_sum(b * b)
            ca = tf.where(na > 0, 1.0 - dot / (2 * tf.where(na > 0, na, 1.0)), 1.0)
            cb = tf.where(nb > 0, 1.0 - dot / (2 * tf.where(nb > 0, nb, 1.0)), 1.0)
            nxt.append(ca * a + cb * b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return tf.cast(level[0], dtype)


def _gather_equal(tensor, name=None):
    """CollectiveGatherV2: every rank's ``tensor`` (same shape everywhere) along axis 0."""
    tf = _tf()
    wide = _widen(tensor)
    out = tf.raw_ops.CollectiveGatherV2(
        input=wide, group_size=state.size, group_key=GROUP_KEY, instance_key=runtime.next_key(),
        ordering_token=[], communication_hint=_hint(), timeout_seconds=runtime.op_timeout(), name=name)
    return _narrow(out, tensor.dtype)


def allgather(tensor, name=None):
    """Every rank's ``tensor`` along axis 0; the first dimension may differ between ranks."""
    tf = _tf()
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    # Gather every rank's length, pad to the longest, gather, then cut the padding out.
    n = tf.shape(tensor, out_type=tf.int64)[:1]
    lengths = _gather_equal(n)
    inner = tensor.shape[1:]
    if inner.is_fully_defined() and inner.num_elements() == 0:  # rows of no elements: nothing to move
        return tf.zeros(tf.concat([[tf.reduce_sum(lengths)], tf.cast(inner.as_list(), tf.int64)], 0), tensor.dtype)
    # At least one row: TensorFlow's gather crashes the process on empty tensors.
    longest = tf.maximum(tf.reduce_max(lengths), 1)
    pad = tf.concat([[[0, longest - n[0]]], tf.zeros([tf.rank(tensor) - 1, 2], tf.int64)], axis=0)
    gathered = _gather_equal(tf.pad(tensor, pad), name=name)
    mask = tf.sequence_mask(lengths, longest)
    shape = tf.concat([[state.size, longest], tf.shape(tensor, out_type=tf.int64)[1:]], 0)
    out = tf.boolean_mask(tf.reshape(gathered, shape), mask)
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def broadcast(tensor, root_rank: int, name=None):
    tf = _tf()
    wide = _widen(tensor)
    common = dict(group_size=state.size, group_key=GROUP_KEY, instance_key=runtime.next_key(),
                  communication_hint=_hint(), timeout_seconds=runtime.op_timeout(), name=name)
    if state.rank == root_rank:
        out = tf.raw_ops.CollectiveBcastSendV2(input=wide, **common)
    else:
        out = tf.raw_ops.CollectiveBcastRecvV2(T=wide.dtype, shape=tf.shape(wide), **common)
    out = _narrow(out, tensor.dtype)
    out.set_shape(tensor.shape)
    return out


def row_split(n, size: int, rank: int):
    """Horovod's rows of ``n`` (an int64 tensor) for ``rank``: ``(start, count)``; the first
    ``n % size`` ranks get one row more."""
    tf = _tf()
    base, extra = n // size, n % size
    start = rank * base + tf.minimum(tf.constant(rank, tf.int64), extra)
    return start, base + tf.cast(rank < extra, tf.int64)


def padded_blocks(tensor, counts, block):
    """``tensor``'s rows cut into ``len(counts)`` consecutive parts of ``counts[k]`` rows, each
    padded with zero rows to ``block`` rows, one after another: ``[len(counts) * block, ...]``.

    An even split of the result gives part ``k`` to rank ``k``, which is what TensorFlow's
    collectives need, whatever the parts' own sizes."""
    tf = _tf()
    starts = tf.cumsum(counts, exclusive=True)
    tail = tf.zeros([tf.rank(tensor) - 1, 2], tf.int64)
    parts = [tf.pad(tensor[starts[k]:starts[k] + counts[k]], tf.concat([[[0, block - counts[k]]], tail], 0))
             for k in range(int(counts.shape[0]))]
    return tf.concat(parts, axis=0)


def reducescatter(tensor, op: str, name=None):
    """This rank's rows of the reduction: the first ``n % size`` ranks get one row more."""
    tf = _tf()
    n = tf.shape(tensor, out_type=tf.int64)[0]
    size, me = state.size, state.rank
    start, count = row_split(n, size, me)
    if not state.gpu or op == "adasum":
        return allreduce(tensor, op, name=name)[start:start + count]
    counts = tf.stack([row_split(n, size, r)[1] for r in range(size)])
    block = tf.maximum(counts[0], 1)  # rank 0 has the most rows; NCCL moves no empty buffers
    wide = padded_blocks(_widen(tensor), counts, block)
    out = tf.raw_ops.CollectiveReduceScatterV2(
        input=wide, group_size=size, group_key=GROUP_KEY, instance_key=runtime.next_key(), ordering_token=[],
        merge_op=_MERGE[op], final_op="Div" if op == "average" else "Id", communication_hint=_hint(),
        timeout_seconds=runtime.op_timeout(), name=name)
    return _narrow(out[:count], tensor.dtype)


def alltoall(tensor, splits):
    """Rows ``splits[k]`` (in order) of ``tensor`` to rank ``k``; returns what this rank received,
    in rank order, and how many rows came from each rank (int32)."""
    tf = _tf()
    size, me = state.size, state.rank
    every = tf.reshape(allgather(tf.reshape(tf.cast(splits, tf.int64), [1, -1])), [size, size])
    counts = every[:, me]
    if state.gpu:
        block = tf.maximum(tf.reduce_max(every), 1)  # NCCL moves no empty buffers
        wide = padded_blocks(_widen(tensor), every[me], block)
        out = tf.raw_ops.CollectiveAllToAllV2(
            input=wide, group_size=size, group_key=GROUP_KEY, instance_key=runtime.next_key(), ordering_token=[],
            communication_hint=_hint(), timeout_seconds=runtime.op_timeout())
        shape = tf.concat([[size, block], tf.shape(wide, out_type=tf.int64)[1:]], 0)
        received = tf.boolean_mask(tf.reshape(out, shape), tf.sequence_mask(counts, block))
        return _narrow(received, tensor.dtype), tf.cast(counts, tf.int32)
    data = allgather(tensor)
    lengths = tf.reduce_sum(every, axis=1)
    starts = tf.cumsum(lengths, exclusive=True) + tf.reduce_sum(every[:, :me], axis=1)
    parts = [data[starts[r]:starts[r] + counts[r]] for r in range(size)]
    return tf.concat(parts, axis=0), tf.cast(counts, tf.int32)
