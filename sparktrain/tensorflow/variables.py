"""Variables from the root rank: ``broadcast_variables`` (Horovod's ``broadcast_global_variables``
in TensorFlow 1 graphs) and the in-place ``broadcast_``, over the broadcast of ``collectives``.
Eagerly and in a ``tf.function`` each assigns at the call; in a TensorFlow 1 graph each returns
what runs the assignment in the session."""
from __future__ import annotations

from typing import Iterable

from . import backends
from .collectives import _broadcast_raw, _check_root, _group, _tf, global_process_set
from .runtime import require_init
from ..errors import InvalidArgumentError, UnsupportedError


#: Dtypes the collectives do not carry, broadcast as the signed type of their size (bit for bit):
#: Keras 3.2's random layers keep their seed state in a uint32 variable.
_CARRIED_AS = {"uint32": "int32", "uint64": "int64"}


def _assign_from_root(variables: list, root: int, g) -> list:
    """Each variable assigned its value on the root (``root``: its index in the group ``g``), one
    broadcast per dtype; returns what each assignment returns, which in a TensorFlow 1 graph is
    what runs it."""
    tf = _tf()
    values = [tf.convert_to_tensor(v) for v in variables]  # Keras 3 variables report their dtype as a string
    if g.size == 1:
        return values
    carried = [tf.bitcast(x, _CARRIED_AS[x.dtype.name]) if x.dtype.name in _CARRIED_AS else x for x in values]
    received = backends.fused(carried, lambda flat: _broadcast_raw(flat, root, g=g))
    return [v.assign(tf.bitcast(r, x.dtype) if r.dtype != x.dtype else r)
            for v, x, r in zip(variables, values, received)]


def broadcast_variables(variables: Iterable, root_rank: int = 0, process_set=global_process_set,
                        inplace: bool = False):
    """Assign every variable the value it has on ``root_rank``, one broadcast per dtype, on the
    ranks of ``process_set`` (default: all; ``root_rank`` is a global rank in it).

    The assignment is always in place; ``inplace`` (Horovod's memory-saving variant) is accepted.
    Eagerly and in a ``tf.function`` it happens at the call; in a TensorFlow 1 graph the call
    returns the op that does it, to run in the session, as Horovod's does.
    """
    require_init()
    g = _group(process_set)
    variables = list(variables)
    root = _check_root(root_rank, g)
    assigned = _assign_from_root(variables, root, g) if variables else []
    return _tf().group(*assigned) if backends.in_graph() else None


def broadcast_global_variables(root_rank: int = 0):
    """Horovod's TensorFlow 1 call: in a TensorFlow 1 graph, the op that assigns every global
    variable its value on ``root_rank``. TensorFlow 2's eager mode has no global variables to
    find (Horovod refuses it there too): an error naming what to call instead."""
    if backends.in_graph():
        return broadcast_variables(_tf().compat.v1.global_variables(), root_rank)
    raise UnsupportedError(f"broadcast_global_variables({root_rank!r}) needs TensorFlow 1 global variables; "
                           "call broadcast_variables(model.variables, root_rank) (or the Keras callback "
                           "BroadcastGlobalVariablesCallback) instead")


def broadcast_(variables, root_rank: int = 0, name: str | None = None, process_set=global_process_set):
    """Broadcast in place: every variable takes its value on ``root_rank``; returns their new
    values (tensors, in order; one tensor when given one variable), as Horovod's ``broadcast_``."""
    single = not isinstance(variables, (list, tuple))
    items = [variables] if single else list(variables)
    for v in items:
        if not hasattr(v, "assign"):
            raise InvalidArgumentError(f"broadcast_ assigns variables in place; got a {type(v).__name__}. Use "
                                       "broadcast() for tensors")
    require_init()
    g = _group(process_set)
    root = _check_root(root_rank, g)
    # What each assignment returns is its new value, read after it (in a graph, running it).
    values = [_tf().convert_to_tensor(a) for a in _assign_from_root(items, root, g)]
    return values[0] if single else values
