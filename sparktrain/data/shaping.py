"""Labels in the shape of the model's outputs: the rule that ``KerasEstimator`` and
``sparktrain.data``'s ``model=`` share.

A label column holds ``n`` values per row. Where the model's output holds ``n`` values in all, the
label is reshaped to the output's shape: ``(batch,)`` to ``(batch, 1)`` for an output of one value,
a flat array to ``(batch, h, w)``. A label of one value for an output of several (a class id for a
sparse loss) is fed as it is. Any other length cannot be fed to that output. Keras 3 hands a
metric function ``y_true`` and ``y_pred`` as they come, so a label of ``(batch,)`` against an
output of ``(batch, 1)`` broadcast to ``(batch, batch)`` in ``y_true - y_pred`` (tf_keras
reshaped them first); sample weights stay one value per row, ``(batch,)``, for every output.

No TensorFlow or Keras here: the shapes come from ``model.outputs[i].shape``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["label_target", "output_shapes", "label_shaper"]


def label_target(n: int | None, shape: tuple) -> tuple | None:
    """The shape (batch left out) a label of ``n`` values per row is reshaped to for an output of
    ``shape``; None where it is fed as it is (``n`` unknown, an open dimension, or one value per
    row for an output of several: a sparse class id). Raises ValueError for any other length."""
    if n is None or any(d is None for d in shape):
        return None
    if n == math.prod(shape):
        return tuple(shape)
    if n == 1:
        return None
    raise ValueError(f"{n} value(s) per row for an output of shape {tuple(shape)}, {math.prod(shape)} value(s)")


def output_shapes(model: Any) -> dict[str, tuple]:
    """The model's outputs by name, each its shape with the batch left out (None where open)."""
    outputs = list(model.outputs)
    names = list(getattr(model, "output_names", None) or [t.name for t in outputs])
    return {name: tuple(None if d is None else int(d) for d in t.shape[1:]) for name, t in zip(names, outputs)}


def label_shaper(model: Any, label: Any) -> Callable[[Any], Any]:
    """A function that reshapes a batch's labels (an array, or a dict by output name, as
    ``label`` names them) to ``model``'s outputs; checked against the first batch it is given.

    A label that is not a dict feeds the model's one output; a dict's keys are output names.
    """
    outputs = output_shapes(model)
    if isinstance(label, Mapping):
        unknown = [k for k in label if k not in outputs]
        if unknown:
            raise InvalidArgumentError(
                f"label={dict(label)!r}: {unknown} name no output of the model (its outputs: {list(outputs)}); key the "
                "label dict by the model's output names")
    elif len(outputs) != 1:
        raise InvalidArgumentError(
            f"label={label!r} is one label and the model has {len(outputs)} outputs {list(outputs)}: pass a dict "
            "{output_name: column} with one label column per output")
    targets: dict[str, tuple | None] = {}

    def one(name: str, column: Any, y: np.ndarray) -> np.ndarray:
        if name not in targets:
            n = int(math.prod(y.shape[1:]))
            try:
                targets[name] = label_target(n, outputs[name])
            except ValueError:
                shape = outputs[name]
                raise InvalidArgumentError(
                    f"label {column!r} holds {n} value(s) per row, and the model's output {name!r} has shape {shape}, "
                    f"{math.prod(shape)} value(s): give the label {math.prod(shape)} values per row (one-hot for "
                    "classes), or one class id per row for a sparse loss") from None
        target = targets[name]
        return y if target is None else y.reshape((len(y), *target))

    if isinstance(label, Mapping):
        return lambda y: {k: one(k, label[k], v) for k, v in y.items()}
    name = next(iter(outputs))
    return lambda y: one(name, label, y)
