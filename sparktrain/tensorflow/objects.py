"""Collectives on picklable Python objects (Horovod's ``functions.py``): ``broadcast_object``,
``allgather_object`` and ``broadcast_object_fn``. Objects travel pickled (cloudpickle, as
Horovod's), as uint8 tensors over the same engine as every other collective. Eagerly, or in a TensorFlow 1
graph, where, as Horovod's do, they build their collectives and run them at once in ``session``
(default: the graph's default session, else a session of their own); not inside ``tf.function``."""
from __future__ import annotations

import io

from . import collectives
from .runtime import require_init
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


def _not_in_function(what: str) -> None:
    if _tf().inside_function():
        raise InvalidArgumentError(f"{what} moves Python objects, which a tf.function cannot return; call it "
                                   "eagerly (outside tf.function), or in a TensorFlow 1 graph with a session")


def _value(tensor, session):
    """``tensor``'s value as numpy: eagerly, or run in ``session`` (a TensorFlow 1 graph)."""
    tf = _tf()
    if tf.executing_eagerly():
        return tensor.numpy()
    sess = session or tf.compat.v1.get_default_session()
    if sess is not None:
        return sess.run(tensor)
    with tf.compat.v1.Session() as own:
        return own.run(tensor)


def broadcast_object(obj, root_rank: int = 0, session=None, name: str | None = None,
                     process_set=collectives.global_process_set):
    """``obj`` as it is on ``root_rank``, on every rank of ``process_set`` (the others pass
    anything, say None)."""
    require_init()
    _not_in_function("broadcast_object")
    g = collectives._group(process_set)
    root = collectives._check_root(root_rank, g)
    tf = _tf()
    if g.size == 1:
        return obj
    payload = _dumps(obj) if g.rank == root else b""
    length = collectives.broadcast(tf.constant([len(payload)], tf.int64), root_rank, process_set=process_set)
    n = int(_value(length, session)[0])
    import numpy as np

    data = np.frombuffer(payload, np.uint8) if g.rank == root else np.zeros(n, np.uint8)
    data = _value(collectives.broadcast(tf.constant(data, tf.uint8), root_rank, process_set=process_set), session)
    return obj if g.rank == root else _loads(bytes(data))


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None,
                        process_set=collectives.global_process_set):
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's helper)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj, session=None, name: str | None = None, process_set=collectives.global_process_set) -> list:
    """Every rank's ``obj`` (of ``process_set``'s ranks), in rank order."""
    require_init()
    _not_in_function("allgather_object")
    g = collectives._group(process_set)
    tf = _tf()
    import numpy as np

    payload = np.frombuffer(_dumps(obj), np.uint8)
    if g.size == 1:
        return [obj]
    sizes = _value(collectives.allgather(tf.constant([payload.size], tf.int64), process_set=process_set), session)
    data = _value(collectives.allgather(tf.constant(payload, tf.uint8), process_set=process_set), session)
    out, offset = [], 0
    for n in sizes:
        out.append(_loads(data[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out
