"""The collectives on numpy arrays over the native engine (``sparktrain.engine.Communicator``).

The engine runs every op but Adasum itself, and checks on every collective that the ranks
agree (kind, shape, dtype, op, root): a disagreement is the same ``MISMATCH`` error on every
rank and the communicator stays usable. Adasum is built on the engine's allgather and computed
identically on every rank, in rank order, so every rank gets the same bits.
Pure of TensorFlow: numpy in, numpy out.
"""
from __future__ import annotations

import numpy as np

from ..engine.topology import dtype_groups  # noqa: F401 - the backends call it as hostops.dtype_groups


def adasum(parts: list) -> np.ndarray:
    """Horovod's Adasum of ``parts`` (one array per rank), in float64.

    Two gradients combine as ``(1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``; ranks combine
    pairwise in a binary tree in rank order (0+1, 2+3, then (0+1)+(2+3), ...), as Horovod's
    recursive halving does for power-of-two sizes. For other sizes (which Horovod refuses) the
    last rank of an odd level passes up unpaired to the next level.
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
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0  # a zero gradient adds nothing either way
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


def allreduce(comm, a: np.ndarray, op: str) -> np.ndarray:
    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    if op == "adasum":
        stack = comm.allgather(a.reshape((1,) + a.shape))  # one row per rank, shapes checked
        return adasum(list(stack)).astype(a.dtype).reshape(a.shape)
    return comm.allreduce(a, op)




def grouped_allreduce(comm, arrays: list, op: str) -> list:
    """One engine call per dtype on one flat buffer (Adasum: per array, as Horovod's)."""
    if op == "adasum":
        return [allreduce(comm, a, op) for a in arrays]
    out: list = [None] * len(arrays)
    for idx in dtype_groups([a.dtype.name for a in arrays]):
        flat = np.concatenate([arrays[i].reshape(-1) for i in idx]) if len(idx) > 1 else \
            np.array(arrays[idx[0]].reshape(-1))  # never write into an input: TensorFlow owns it
        comm.allreduce_(flat, op)
        offset = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
            offset += n
    return out


def allgather(comm, a: np.ndarray) -> np.ndarray:
    return comm.allgather(np.asarray(a, order="C"))


def broadcast(comm, a: np.ndarray, root: int) -> np.ndarray:
    return comm.broadcast(np.asarray(a, order="C"), root)


def reducescatter(comm, a: np.ndarray, op: str) -> np.ndarray:
    return comm.reducescatter(np.asarray(a, order="C"), op)


def alltoall(comm, a: np.ndarray, splits: np.ndarray) -> tuple:
    """Send rows ``splits[k]`` of ``a`` (in order) to rank ``k``; returns what this rank
    received (rank order) and how many rows came from each rank (int32)."""
    received, counts = comm.alltoall(np.asarray(a, order="C"), np.asarray(splits, np.int64).reshape(-1))
    return received, np.asarray(counts, np.int32)
