"""The front that serves this process's Keras, chosen once (``kerasline.front``), and its backend: what
``sparktrain.keras``'s callbacks are built for.

``tf.keras`` decides, as it did for Horovod's callbacks: tf_keras (Keras 2) where
``TF_USE_LEGACY_KERAS=1`` (``sparktrain.kerasline``), else Keras 3, on TensorFlow or on JAX. The
callbacks subclass that Keras's ``Callback``, so its ``model.fit`` calls them as its own; one given a
model of the other line refuses it at ``set_model``, naming both. The optimizer wrapper decides by
the object it is given instead (``sparktrain.kerasline.front``).
"""
from __future__ import annotations

from .. import kerasline

#: The front module (``fronts``: Keras 3 on TensorFlow, tf_keras, or Keras 3 on JAX).
served = kerasline.serving()
#: Its backend (``sparktrain._keras.backend``): its Keras module and what differs between the fronts.
backend = served.BACKEND
#: The Keras module served here: ``tf_keras`` or ``keras``.
keras = backend.keras
#: Its line, ``kerasline.TF_KERAS`` or ``kerasline.KERAS_3``.
LINE = backend.line
