"""The reduction ops (Horovod's ``Average``, ``Sum``, ``Adasum``, ``Min``, ``Max``, ``Product``)
and the checks every collective makes of its arguments. Pure of TensorFlow."""
from __future__ import annotations

import warnings

from ..errors import InvalidArgumentError

Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"

ALL = (Average, Sum, Adasum, Min, Max, Product)
_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

#: Every dtype the collectives take, as Horovod's.
DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
FLOATS = ("float16", "bfloat16", "float32", "float64")


def check_op(op) -> str:
    """``op`` if it is one of the reductions; otherwise an error naming it."""
    if not isinstance(op, str) or op not in ALL:
        raise InvalidArgumentError(f"op must be one of sparktrain.tensorflow.Average, Sum, Adasum, Min, Max or "
                                   f"Product, got {op!r}")
    return op


def resolve(op, average) -> str:
    """Horovod's rule for the deprecated ``average=``: either it or ``op``, never both; Average
    when neither is given."""
    if op is not None and average is not None:
        raise InvalidArgumentError(f"both op={op!r} and average={average!r} given: op supersedes the deprecated "
                                   "average; pass only op")
    if average is not None:
        warnings.warn("average= is deprecated, as in Horovod: pass op=Average or op=Sum", DeprecationWarning,
                      stacklevel=3)
        if not isinstance(average, bool):
            raise InvalidArgumentError(f"average must be True or False, got {average!r}; better, pass op=")
        return Average if average else Sum
    return Average if op is None else check_op(op)


def check_dtype(dtype_name: str, op: str | None, what: str) -> None:
    """An error naming the dtype when ``what`` cannot take it (or cannot reduce it with ``op``)."""
    if dtype_name not in DTYPES:
        raise InvalidArgumentError(f"{what} takes tensors of {', '.join(DTYPES)}; got {dtype_name}")
    if op in (Average, Adasum) and dtype_name == "bool":
        raise InvalidArgumentError(f"{what} with op={_NAMES[op]} cannot reduce bool tensors; use op=Sum (logical or), "
                                   "Min or Product (logical and), or cast to a number first")
    if op == Adasum and dtype_name not in FLOATS:
        raise InvalidArgumentError(f"{what} with op=Adasum reduces floating-point tensors only; got {dtype_name}. "
                                   "Cast to float32 or use op=Sum")


def check_scale(prescale_factor, postscale_factor) -> None:
    for name, v in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgumentError(f"{name} must be a number, got {v!r}")


def name_of(op: str) -> str:
    return _NAMES[op]


def handle_average_backwards_compatibility(op, average) -> str:
    """Horovod's helper of that name: the op that ``op`` and the deprecated ``average`` mean."""
    return resolve(op, average)


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Horovod's helper; its Adasum needs one, sparktrain's does not)."""
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0
