"""The collectives on numpy arrays over the native engine (``sparktrain.native.Communicator``).

Whatever the engine runs itself (its ops and dtypes) goes to it directly; the rest is built on
its allgather and computed identically on every rank, in rank order, so every rank gets the
same bits: the ops and dtypes an older engine lacks, Adasum, reducescatter and alltoall.

Where the engine does not check that the ranks agree on a collective (shape, dtype, op), a
small allgather of each rank's description goes first, so disagreement is an error on every
rank, naming the ranks and what differs, and the communicator stays usable.
Pure of TensorFlow: numpy in, numpy out.
"""
from __future__ import annotations

import numpy as np

from .. import native
from ..native import MISMATCH, CollectiveError

_KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "reducescatter": 4, "alltoall": 5}
_OP_CODES = {"average": 1, "sum": 2, "adasum": 3, "min": 4, "max": 5, "product": 6, "": 0}
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(
    ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"))}
_DESC_LEN = 40  # kind, op, dtype, root, ndim, then up to 35 dimensions


def engine_ops() -> set:
    """The reductions the engine runs itself (the engine's table; newer engines have more)."""
    return set(getattr(native, "_OPS", {}))


def engine_dtypes() -> set:
    return set(getattr(native, "_DTYPES", {}))


def engine_checks(comm) -> bool:
    """Whether this engine checks every collective's shape, dtype and op itself: the engine that
    also runs alltoall does."""
    return hasattr(comm, "alltoall")


def _describe(kind: str, op: str, a: np.ndarray, root: int, dims: tuple) -> np.ndarray:
    if len(dims) > _DESC_LEN - 5:
        raise CollectiveError(f"{kind} takes arrays of at most {_DESC_LEN - 5} dimensions, got {len(dims)}")
    d = np.full(_DESC_LEN, -1, np.int64)
    d[:5] = _KINDS[kind], _OP_CODES[op], _DTYPE_CODES.get(str(a.dtype), 99), root, len(dims)
    d[5:5 + len(dims)] = dims
    return d


def _explain(d: np.ndarray) -> str:
    kind = {v: k for k, v in _KINDS.items()}.get(int(d[0]), "?")
    op = {v: k for k, v in _OP_CODES.items()}.get(int(d[1]), "?")
    dtype = {v: k for k, v in _DTYPE_CODES.items()}.get(int(d[2]), "?")
    shape = tuple(int(x) for x in d[5:5 + int(d[4])])
    return f"{kind}{'(' + op + ')' if op else ''} of {dtype} {shape}" + (f" from root {int(d[3])}" if d[0] == 3 else "")


def agree(comm, kind: str, op: str, a: np.ndarray, root: int = -1, dims: tuple | None = None) -> None:
    """Raise (on every rank) when the ranks do not issue the same collective on the same
    shapes and dtypes. ``dims``: what must match (default: the whole shape)."""
    if engine_checks(comm):
        return
    mine = _describe(kind, op, a, root, a.shape if dims is None else dims)
    every = comm.allgather(mine.reshape(1, -1))
    differ = [r for r in range(comm.size) if not np.array_equal(every[r], every[0])]
    if differ:
        groups: dict = {}
        for r in range(comm.size):
            groups.setdefault(_explain(every[r]), []).append(r)
        what = "; ".join(f"rank(s) {', '.join(map(str, rs))}: {desc}" for desc, rs in groups.items())
        raise CollectiveError(f"rank {comm.rank}: the ranks issued different collectives: {what}. Every rank must "
                              "issue the same collectives, with the same op, dtype and shape, in the same order",
                              MISMATCH)


# -- reductions in numpy, identical on every rank ----------------------------------------------

def _reduce_stack(stack: np.ndarray, op: str, dtype) -> np.ndarray:
    """Reduce ``stack`` (ranks on axis 0) with ``op``, in rank order, to ``dtype``."""
    n = stack.shape[0]
    if dtype == np.bool_:
        if op in ("sum", "max"):
            return np.any(stack, axis=0)
        return np.all(stack, axis=0)  # min, product
    if op == "min":
        return np.min(stack, axis=0)
    if op == "max":
        return np.max(stack, axis=0)
    if op == "adasum":
        return adasum(list(stack)).astype(dtype)
    acc = stack[0].copy()
    for r in range(1, n):  # rank order, in the tensor's own dtype (integers wrap, as MPI's)
        acc = (acc * stack[r]) if op == "product" else (acc + stack[r])
    if op == "average":
        if np.issubdtype(dtype, np.integer):
            acc = (np.sign(acc) * (np.abs(acc.astype(np.int64)) // n)).astype(dtype)  # toward zero
        else:
            acc = (acc.astype(np.float64) / n).astype(dtype)
    return acc.astype(dtype, copy=False)


def adasum(parts: list) -> np.ndarray:
    """Horovod's Adasum of ``parts`` (one array per rank), in float64.

    Two gradients combine as ``(1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``; ranks combine
    pairwise in a binary tree in rank order (0+1, 2+3, then (0+1)+(2+3), ...), as Horovod's
    recursive halving does for power-of-two sizes. For other sizes the last rank of an odd
    level passes up unpaired to the next level.
    """
    level = [np.asarray(p, np.float64) for p in parts]
    while len(level) > 1:
        nxt = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(np.dot(a.ravel(), b.ravel()))
    na, nb = float(np.dot(a.ravel(), a.ravel())), float(np.dot(b.ravel(), b.ravel()))
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


# -- the collectives ---------------------------------------------------------------------------

def allreduce(comm, a: np.ndarray, op: str) -> np.ndarray:
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    agree(comm, "allreduce", op, a)
    if op in engine_ops() and str(a.dtype) in engine_dtypes() and op != "adasum":
        return comm.allreduce(a, op)
    stack = comm.allgather(a.reshape((1,) + a.shape))
    return _reduce_stack(stack, op, a.dtype).reshape(a.shape)


def grouped_allreduce(comm, arrays: list, op: str) -> list:
    """One engine call per dtype on one flat buffer (Adasum: per array, as Horovod's)."""
    out: list = [None] * len(arrays)
    if op == "adasum":
        return [allreduce(comm, a, op) for a in arrays]
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.name, []).append(i)
    for name in sorted(by_dtype):  # the same order on every rank
        idx = by_dtype[name]
        flat = np.concatenate([arrays[i].reshape(-1) for i in idx]) if len(idx) > 1 else \
            np.array(arrays[idx[0]].reshape(-1))  # never write into an input: TensorFlow owns it
        flat = allreduce(comm, flat, op)
        offset = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
            offset += n
    return out


def allgather(comm, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    if a.ndim == 0:
        a = a.reshape(1)
    agree(comm, "allgather", "", a, dims=(-1,) + a.shape[1:])
    return comm.allgather(a)


def broadcast(comm, a: np.ndarray, root: int) -> np.ndarray:
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    agree(comm, "broadcast", "", a, root=root)
    return comm.broadcast(a, root)


def scatter_rows(n: int, size: int) -> list:
    """How reducescatter splits ``n`` rows over ``size`` ranks: as evenly as possible, the first
    ``n % size`` ranks one row more (Horovod's rule)."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def reducescatter(comm, a: np.ndarray, op: str) -> np.ndarray:
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    if a.ndim == 0:
        raise CollectiveError("reducescatter needs a tensor of at least one dimension (it splits the first)")
    if hasattr(comm, "reducescatter") and op in engine_ops() and str(a.dtype) in engine_dtypes():
        return comm.reducescatter(a, op)
    reduced = allreduce(comm, a, op)
    rows = scatter_rows(a.shape[0], comm.size)
    start = sum(rows[:comm.rank])
    return np.ascontiguousarray(reduced[start:start + rows[comm.rank]])


def alltoall(comm, a: np.ndarray, splits: np.ndarray) -> tuple:
    """Send rows ``splits[k]`` of ``a`` (in order) to rank ``k``; returns what this rank
    received (rank order) and how many rows came from each rank."""
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    splits = np.asarray(splits, np.int64).reshape(-1)
    if hasattr(comm, "alltoall"):
        received, counts = comm.alltoall(a, splits)
        return received, np.asarray(counts, np.int32)
    agree(comm, "alltoall", "", a, dims=(-1,) + a.shape[1:])
    every = comm.allgather(splits.reshape(1, -1))  # every[r, k]: rows rank r sends to rank k
    data = comm.allgather(a)
    me, lengths = comm.rank, every.sum(axis=1)
    parts, offset = [], 0
    for r in range(comm.size):
        start = offset + int(every[r, :me].sum())
        parts.append(data[start:start + int(every[r, me])])
        offset += int(lengths[r])
    received = np.concatenate(parts) if parts else data[:0]
    return np.ascontiguousarray(received), every[:, me].astype(np.int32)
