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

import importlib
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
#: Keras 3 on its JAX backend: a front of its own, beside the two lines on TensorFlow.
JAX = "jax"
#: Each line's front, ``sparktrain.keras``'s implementation for it (they import none of each other).
FRONTS = {KERAS_3: "sparktrain.keras.fronts.keras3", TF_KERAS: "sparktrain.keras.fronts.tf_keras",
          JAX: "sparktrain.keras.fronts.jax"}
_NAMES = {KERAS_3: "Keras 3 (import keras)", TF_KERAS: "tf_keras (Keras 2, tf.keras under TF_USE_LEGACY_KERAS=1)"}


def legacy_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``tf.keras`` is tf_keras in a process with ``environ`` (default: this one's)."""
    return (os.environ if environ is None else environ).get(LEGACY_ENV) in LEGACY_ON


def module(line: str | None = None):
    """The Keras module of ``line``: ``keras`` (Keras 3) or ``tf_keras``; by default the one this
    process serves (tf_keras where :func:`legacy_requested`). The one mapping from a line to its module."""
    if (served() if line is None else line) == KERAS_3:
        from .seam.versions import require_keras_3

        require_keras_3()  # before Keras is imported: Keras 2 (and its older TensorFlow) is refused at once
        import keras

        return keras
    try:
        import tf_keras
    except ImportError as e:
        asked = f"{LEGACY_ENV}={os.environ[LEGACY_ENV]} asks for" if line is None else "this needs"
        raise ImportError(f"{asked} tf_keras (Keras 2), which is not installed here: pip install tf_keras (the "
                          f"release of your TensorFlow's), or unset {LEGACY_ENV} for Keras 3") from e
    return tf_keras


def on_jax() -> bool:
    """Whether this process's Keras runs on JAX (Keras 3 is imported to ask; tf_keras runs on
    TensorFlow only, and is not asked)."""
    return served() == KERAS_3 and module(KERAS_3).backend.backend() == "jax"


def front(obj: Any = None) -> str:
    """The module of ``sparktrain.keras``'s front that serves ``obj``'s line (Keras 3 on TensorFlow,
    tf_keras, or Keras 3 on JAX); for None, or an object of neither line, this process's."""
    line = line_of(obj) if obj is not None else None
    if line is None:
        line = served()
    if line == KERAS_3 and on_jax():
        return FRONTS[JAX]
    return FRONTS[line]


def serving(obj: Any = None):
    """The front module :func:`front` names for ``obj``, imported: what a caller hands an object of
    that line (or, for None, this process's) to, without importing the Keras layer itself."""
    return importlib.import_module(front(obj))


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


def optimizer_classes(line: str) -> tuple:
    """The optimizer classes of ``line``: tf_keras keeps its legacy ones beside the current."""
    keras = module(line)
    legacy = getattr(keras.optimizers, "legacy", None) if line == TF_KERAS else None
    return (keras.optimizers.Optimizer,) + ((legacy.Optimizer,) if legacy is not None else ())


def is_legacy_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is one of tf_keras' legacy optimizers (``tf.keras.optimizers.legacy.*``), whose
    hyperparameters are numbers until first used and are set with ``_set_hyper``."""
    line = line_of(obj)
    return line is not None and isinstance(obj, optimizer_classes(line)[1:])


def env_for(line: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``TF_USE_LEGACY_KERAS`` set for ``line``, for processes that must serve it; a
    value in ``env`` that asks for the other line is refused, naming both."""
    legacy = line == TF_KERAS
    given = env.get(LEGACY_ENV)
    if given is not None and legacy_requested(env) != legacy:
        raise InvalidArgumentError(
            f"the model is {describe(line)}, and the ranks' env sets {LEGACY_ENV}={given}, which asks for "
            f"{describe(KERAS_3 if legacy else TF_KERAS)}: leave {LEGACY_ENV} out of env and backend_env (the "
            "estimator sets it from the model), or build the model with the other Keras")
    return {**env, LEGACY_ENV: "1" if legacy else "0"}


def check_served(line: str, fix: str) -> None:
    """Refuse to go on where this process serves another line than ``line`` (its environment
    overrode what it was given); ``fix`` says what to do."""
    if served() != line:
        from .errors import SparkTrainError

        raise SparkTrainError(f"this rank serves {describe(served())} ({LEGACY_ENV}={os.environ.get(LEGACY_ENV)}), "
                              f"and the model is {describe(line)}: {fix}")


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
