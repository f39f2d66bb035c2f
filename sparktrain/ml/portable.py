"""Keras objects in a form that pickles on every Keras 3 release and on tf_keras, and back.

Keras 3.2's optimizers hold weak references, so ``pickle``/``cloudpickle`` refuse them ("cannot
pickle 'weakref.ReferenceType' object"), as they refuse tf_keras' optimizers, and a pickled Keras
3.2 model does not load back ("'TrackedList' object has no attribute 'tracker'"). Keras's own
serialization works on every Keras 3 release and on tf_keras, so the estimator ships and saves
them that way, each rebuilt by the Keras line it came from (``kerasline.line_of``):

- an optimizer, loss, metric or learning-rate schedule travels as its class and its
  ``get_config()``, rebuilt with ``from_config``. The class itself is pickled, so a class defined
  in a notebook needs no ``custom_objects``. An object whose ``from_config(get_config())`` fails
  (a custom metric without ``get_config``) travels as itself, as before;
- a model travels as the bytes of its ``.keras`` file and its line, and is loaded back with
  its line's ``models.load_model``.

Lists, tuples and dicts of them (``metrics=[...]``, a loss per output) are walked. Keras is
imported only where a value needs it.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

from ..kerasline import KERAS_3, line_of, module, optimizer_classes


class KerasObject(NamedTuple):
    """An optimizer, loss, metric or schedule, as its class and config."""
    cls: type
    config: dict


class KerasModelFile(NamedTuple):
    """A model, as the bytes of its ``.keras`` file, and the Keras line that loads it."""
    data: bytes
    line: str = KERAS_3


def pack(value: Any) -> Any:
    """``value`` with each Keras object in it replaced by what rebuilds it (see the module's docstring)."""
    if isinstance(value, (KerasObject, KerasModelFile)) or value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, dict):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(pack(v) for v in value)
    line = line_of(value)
    keras = sys.modules.get(line) if line else None  # a Keras object cannot exist before its Keras is imported
    if keras is None:
        return value
    if isinstance(value, keras.Model):
        return KerasModelFile(keras_bytes(value), line)
    kinds = (*optimizer_classes(line), keras.losses.Loss, keras.metrics.Metric,
             keras.optimizers.schedules.LearningRateSchedule)
    if not isinstance(value, kinds):
        return value
    config = value.get_config()
    try:
        type(value).from_config(dict(config))
    except Exception:  # noqa: BLE001 - an incomplete get_config: the object travels as itself
        return value
    return KerasObject(type(value), config)


def unpack(value: Any, custom_objects: dict | None = None) -> Any:
    """The inverse of :func:`pack`: each :class:`KerasObject` and :class:`KerasModelFile` rebuilt."""
    if isinstance(value, KerasObject):
        with module(line_of(value.cls)).utils.custom_object_scope(custom_objects or {}):
            return value.cls.from_config(dict(value.config))
    if isinstance(value, KerasModelFile):
        return load_bytes(value.data, custom_objects, value.line)
    if isinstance(value, dict):
        return {k: unpack(v, custom_objects) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(unpack(v, custom_objects) for v in value)
    return value


def keras_bytes(model) -> bytes:
    """``model`` (Keras 3 or tf_keras) as the bytes of a ``.keras`` file."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def load_bytes(data: bytes, custom_objects, line: str = KERAS_3):
    """The model whose ``.keras`` file's bytes are ``data`` (not compiled), loaded by ``line``."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparktrain-model-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return load_file(path, custom_objects, line)


def load_file(path: str, custom_objects, line: str = KERAS_3):
    """The model saved at local ``path`` (not compiled), loaded by the Keras of ``line``."""
    return module(line).models.load_model(path, custom_objects=custom_objects, compile=False)
