"""Collectives on picklable Python objects (Horovod's ``functions.py``): ``broadcast_object``,
``allgather_object`` and ``broadcast_object_fn``. Objects travel pickled (cloudpickle, as
Horovod's), as uint8 tensors over the same engine as every other collective. Eager only."""
from __future__ import annotations

import io

from . import collectives
from .runtime import require_init, state
from ..errors import InvalidArgumentError


def _tf():
    import tensorflow as tf

    return tf


def _dumps(obj) -> bytes:
    import cloudpickle

    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    import cloudpickle

    return cloudpickle.loads(data)


def _eager(what: str) -> None:
    if not _tf().executing_eagerly():
        raise InvalidArgumentError(f"{what} moves Python objects and runs eagerly only; call it outside tf.function")


def broadcast_object(obj, root_rank: int = 0, session=None, name: str | None = None,
                     process_set=collectives.global_process_set):
    """``obj`` as it is on ``root_rank``, on every rank (the others pass anything, say None)."""
    require_init()
    _eager("broadcast_object")
    collectives._check_process_set(process_set)
    collectives._check_root(root_rank)
    tf = _tf()
    if state.size == 1:
        return obj
    payload = _dumps(obj) if state.rank == root_rank else b""
    length = collectives.broadcast(tf.constant([len(payload)], tf.int64), root_rank)
    n = int(length.numpy()[0])
    import numpy as np

    data = np.frombuffer(payload, np.uint8) if state.rank == root_rank else np.zeros(n, np.uint8)
    data = collectives.broadcast(tf.constant(data, tf.uint8), root_rank)
    return obj if state.rank == root_rank else _loads(bytes(data.numpy()))


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None,
                        process_set=collectives.global_process_set):
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's helper)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj, session=None, name: str | None = None, process_set=collectives.global_process_set) -> list:
    """Every rank's ``obj``, in rank order."""
    require_init()
    _eager("allgather_object")
    collectives._check_process_set(process_set)
    tf = _tf()
    import numpy as np

    payload = np.frombuffer(_dumps(obj), np.uint8)
    if state.size == 1:
        return [obj]
    sizes = collectives.allgather(tf.constant([payload.size], tf.int64)).numpy()
    data = collectives.allgather(tf.constant(payload, tf.uint8)).numpy()
    out, offset = [], 0
    for n in sizes:
        out.append(_loads(data[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out
