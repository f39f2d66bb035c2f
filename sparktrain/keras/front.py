"""The Keras that this process's ``sparktrain.keras`` serves, chosen once, and what its callbacks share.

``tf.keras`` decides, as it did for Horovod's callbacks: tf_keras (Keras 2) where
``TF_USE_LEGACY_KERAS=1`` (``sparktrain.kerasline``), else Keras 3. The callbacks subclass that
line's ``Callback``, so its ``model.fit`` calls them as its own; one given a model of the other
line refuses it at ``set_model``, naming both. The optimizer wrapper decides by the object it is
given instead (``sparktrain.kerasline.front``).
"""
from __future__ import annotations

from .. import kerasline

#: The Keras module served here: ``tf_keras`` or ``keras``.
keras = kerasline.module()
#: Its line, ``kerasline.TF_KERAS`` or ``kerasline.KERAS_3``.
LINE = kerasline.line_of(keras.callbacks.Callback)


class Callback(keras.callbacks.Callback):
    """The base of sparktrain's callbacks: the served line's ``Callback``, which refuses a model of
    the other line as soon as ``fit`` hands it over."""

    def set_model(self, model):
        kerasline.check_same_line(model=model, callback=self)
        super().set_model(model)


def value(x) -> float:
    """A Keras scalar (a variable, a tensor, a number) as a Python float, on either line."""
    if isinstance(x, (int, float)):
        return float(x)
    convert = getattr(getattr(keras, "ops", None), "convert_to_numpy", None) or keras.backend.get_value
    return float(convert(x))


def is_variable(v) -> bool:
    """Whether ``v`` is a variable of the served Keras or of TensorFlow."""
    import tensorflow as tf

    if isinstance(v, tf.Variable):
        return True
    variable = getattr(keras, "Variable", None)  # Keras 3 only
    # A layer's variables are the backend's Variable class: keras.Variable itself from Keras 3.6
    # or so, its base before (3.2-3.5 export a subclass of it as keras.Variable). The class right
    # after keras.Variable in its MRO is that backend class in every release.
    return variable is not None and isinstance(v, (variable.__mro__[1], variable))
