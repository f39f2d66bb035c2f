"""``sparktrain.keras``'s fronts, one per Keras it serves, side by side and importing none of each other:
``keras3`` (Keras 3 on TensorFlow), ``tf_keras`` (Keras 2) and ``jax`` (Keras 3 on JAX). Each binds
its own Keras module to the one implementation (``sparktrain._keras``); ``sparktrain.kerasline.front``
says which front serves an object, or this process."""
