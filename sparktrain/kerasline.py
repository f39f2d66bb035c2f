"""Which Keras line a process serves, and which line an object belongs to: Keras 3 or tf_keras.

tf_keras is Keras 2 as a package of its own. TensorFlow 2.16+ makes ``tf.keras`` tf_keras where
``TF_USE_LEGACY_KERAS`` is ``1``, ``true`` or ``True`` (Databricks tells Keras 2 users to set it);
sparktrain follows the same rule, read the same way, so ``sparktrain.keras`` serves the Keras that
``tf.keras`` is. Objects carry their line in their classes' modules, which is how a wrapper decides
what it was given: by the object, not by a version number.

Pure: nothing here imports Keras or TensorFlow until :func:`module` is called.

>>> legacy_requested({"TF_USE_LEGACY_KERAS": "1"}), legacy_requested({})
(True, False)
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .errors import InvalidArgumentError

#: The variable TensorFlow reads to route ``tf.keras`` to tf_keras.
LEGACY_ENV = "TF_USE_LEGACY_KERAS"
#: The values TensorFlow takes for "on" (tensorflow/python/util/lazy_loader.py); any other leaves Keras 3.
LEGACY_ON = ("1", "true", "True")
#: The values that say "off" as plainly (the ``legacy_keras`` setting takes these, or those above).
LEGACY_OFF = ("0", "false", "False", "")
KERAS_3 = "keras"
TF_KERAS = "tf_keras"
_NAMES = {KERAS_3: "Keras 3 (import keras)", TF_KERAS: "tf_keras (Keras 2, tf.keras under TF_USE_LEGACY_KERAS=1)"}


def legacy_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``tf.keras`` is tf_keras in a process with ``environ`` (default: this one's)."""
    return (os.environ if environ is None else environ).get(LEGACY_ENV) in LEGACY_ON


def module():
    """The Keras module this process serves: ``tf_keras`` where :func:`legacy_requested`, else ``keras``."""
    if not legacy_requested():
        import keras

        return keras
    try:
        import tf_keras
    except ImportError as e:
        raise ImportError(f"{LEGACY_ENV}={os.environ[LEGACY_ENV]} asks for tf_keras (Keras 2), which is not "
                          "installed here: pip install tf_keras (the release of your TensorFlow's), or unset "
                          f"{LEGACY_ENV} for Keras 3") from e
    return tf_keras


def line_of(obj: Any) -> str | None:
    """``"tf_keras"`` or ``"keras"`` (Keras 3) for a Keras object or class, by where its classes
    were defined; None for anything else (a plain TensorFlow or Python object)."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        top = (getattr(klass, "__module__", None) or "").split(".", 1)[0]
        if top == TF_KERAS:
            return TF_KERAS
        if top == KERAS_3:
            return KERAS_3
    return None


def describe(line: str | None) -> str:
    """The line's name as an error message gives it."""
    return _NAMES.get(line, "neither Keras")


def served() -> str:
    """The line this process serves (:func:`module`'s), without importing it."""
    return TF_KERAS if legacy_requested() else KERAS_3


def check_same_line(**objects: Any) -> str | None:
    """The one Keras line of ``objects`` (name=object; None and non-Keras values are skipped), or
    None where none is Keras. Objects of both lines are refused, naming each and the fix.

    >>> check_same_line(model=None)
    """
    lines = {name: line_of(obj) for name, obj in objects.items() if obj is not None}
    found = {line for line in lines.values() if line is not None}
    if len(found) > 1:
        listing = ", ".join(f"{name} is {type(objects[name]).__module__}.{type(objects[name]).__name__} "
                            f"({describe(line)})" for name, line in lines.items() if line is not None)
        raise InvalidArgumentError(
            f"Keras 3 and tf_keras objects cannot train together: {listing}. Build them all with one Keras: "
            f"`import keras` for Keras 3, or tf.keras with {LEGACY_ENV}=1 (or `import tf_keras`) for Keras 2")
    return found.pop() if found else None
