"""Which Keras a fit serves: Keras 3 or tf_keras (Keras 2), decided by the model the user passes.

A tf_keras model (``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``, or ``import tf_keras``) trains on
ranks whose ``TF_USE_LEGACY_KERAS`` is ``1``, so that ``sparktrain.keras`` there serves tf_keras,
and the trained model is loaded and scored with tf_keras; a Keras 3 model, on ranks where it is
``0``. The optimizer, loss, metrics and callbacks must be of the model's line (or of none: a name
such as ``"adam"``, a plain function); objects of both lines are refused on the driver, before
any Spark job, naming each (``kerasline.check_same_line``).
"""
from __future__ import annotations

from typing import Any, Mapping

from .. import kerasline
from ..errors import InvalidArgumentError


def keras_of(line: str):
    """The Keras module of ``line``: ``keras`` (Keras 3) or ``tf_keras`` (``kerasline.module``)."""
    return kerasline.module(line)


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def check_model(model) -> tuple[Any, str]:
    """``model`` and its line; refuses anything but a built Keras 3 or tf_keras model."""
    if model is None:
        raise InvalidArgumentError("model is not set: pass model=keras.Sequential([...]) (built, not compiled)")
    line = kerasline.line_of(model)
    if line is None or not isinstance(model, keras_of(line).Model):
        raise InvalidArgumentError(
            f"model must be a Keras model, got {_kind(model)}: build it with Keras 3 (`import keras`) or with tf_keras "
            f"(tf.keras under {kerasline.LEGACY_ENV}=1, or `import tf_keras`)")
    try:
        inputs = model.inputs
        model.outputs
    except (AttributeError, ValueError) as e:
        raise InvalidArgumentError(f"model {model.name!r} is not built, so its inputs are unknown: give it an "
                                   "input shape (keras.Input(shape=...)) before fit") from e
    if not inputs:
        raise InvalidArgumentError(f"model {model.name!r} is not built: give it keras.Input(shape=...)")
    return model, line


def check_same_line(model, optimizer, loss, metrics, callbacks, checkpoint_callback) -> None:
    """Refuse Keras objects of the other line than the model's, naming each and the fix."""
    objects = {"model": model, "optimizer": optimizer, "checkpoint_callback": checkpoint_callback}
    for name, value in (("loss", loss), ("metrics", metrics), ("callbacks", callbacks)):
        if isinstance(value, Mapping):
            objects.update({f"{name}[{k!r}]": v for k, v in value.items()})
        elif isinstance(value, (list, tuple)):
            objects.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        else:
            objects[name] = value
    kerasline.check_same_line(**objects)


def check_checkpoint_callback(callback, line: str):
    """``callback``, a callback of the model's line that saves to its ``filepath``; or None."""
    if callback is None:
        return None
    keras = keras_of(line)
    if not isinstance(callback, keras.callbacks.Callback) or not hasattr(callback, "filepath"):
        raise InvalidArgumentError(
            f"checkpoint_callback must be a Keras callback that saves the model to its filepath, such as "
            "keras.callbacks.ModelCheckpoint('best.keras', monitor='val_loss', save_best_only=True) or "
            f"sparktrain.keras.callbacks.BestModelCheckpoint(monitor='val_loss'); got {_kind(callback)}")
    return callback


def rank_env(line: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the ranks' ``TF_USE_LEGACY_KERAS`` set for ``line``; a value in ``env`` that asks
    for the other line is refused (``kerasline.env_for``)."""
    return kerasline.env_for(line, env)
