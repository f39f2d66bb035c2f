"""Where each rank sits: its host's node number and its place on the host, and the name of a
host's shared-memory segment; how buffers group into engine calls (by dtype, in gradient buckets)."""
from __future__ import annotations

import hashlib
from typing import Sequence


def layout(hosts: Sequence[str], force_tcp: bool = False) -> tuple[list[int], list[int]]:
    """Each rank's host index (in order of first appearance) and local rank.

    With ``force_tcp`` every rank is a host of its own, so ranks on one machine use the ring.

    >>> layout(["a", "b", "a"])
    ([0, 1, 0], [0, 0, 1])
    """
    if force_tcp:
        return list(range(len(hosts))), [0] * len(hosts)
    index: dict[str, int] = {}
    nodes, locals_ = [], []
    counts: dict[str, int] = {}
    for h in hosts:
        nodes.append(index.setdefault(h, len(index)))
        locals_.append(counts.get(h, 0))
        counts[h] = counts.get(h, 0) + 1
    return nodes, locals_


def segment_name(name: str, node: int) -> str:
    """The shared-memory segment of run ``name`` on host ``node`` (``/dev/shm`` + this, on Linux)."""
    return f"/sparktrain-{hashlib.sha256(name.encode()).hexdigest()[:16]}-h{node}"


def dtype_groups(dtype_names: list[str]) -> list[list[int]]:
    """The positions of each dtype's tensors, the dtypes in name order: the order in which every
    grouped collective (here, in the kernels and on TensorFlow's runtime) makes its one call per
    dtype, so that ranks on either path issue the same calls.

    >>> dtype_groups(["float32", "int64", "float32", "bfloat16"])
    [[3], [0, 2], [1]]
    """
    by_dtype: dict[str, list[int]] = {}
    for i, name in enumerate(dtype_names):
        by_dtype.setdefault(name, []).append(i)
    return [by_dtype[name] for name in sorted(by_dtype)]


def split_buckets(sizes: list, limit: int) -> list[list[int]]:
    """Positions ``0..len(sizes)-1`` (gradients in their variables' order) in buckets, the last
    positions first, as backprop makes them (the gradient buckets of ``sparktrain.tensorflow.buckets``
    and ``sparktrain._jax.collectives``): each bucket takes positions from the end until it holds
    ``limit`` bytes or more; a size None (unknown until the step runs) closes a bucket of its own.

    >>> split_buckets([4, 4, 4, 4, 16], 8)
    [[4], [2, 3], [0, 1]]
    >>> split_buckets([4, None, 4], 100)
    [[2], [1], [0]]
    """
    out: list[list[int]] = []
    bucket: list[int] = []
    held = 0
    for i in reversed(range(len(sizes))):
        size = sizes[i]
        if size is None:
            if bucket:
                out.append(sorted(bucket))
            out.append([i])
            bucket, held = [], 0
            continue
        bucket.append(i)
        held += size
        if held >= limit:
            out.append(sorted(bucket))
            bucket, held = [], 0
    if bucket:
        out.append(sorted(bucket))
    return out
