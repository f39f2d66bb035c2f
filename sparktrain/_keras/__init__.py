"""The Horovod-on-Keras implementation on TensorFlow, written once for both Keras lines: each piece takes
the Keras module (and what differs between the lines) from the front that binds it
(``sparktrain.keras.fronts``).

``optimizer`` (``DistributedOptimizer``, ``PartialDistributedOptimizer``, ``load_model``, and the
:class:`~sparktrain._keras.optimizer.Line` a front gives them), ``reduction`` (Horovod's arguments
checked, and the gradients reduced), ``update_step`` (Keras 3: the reduction inside the update step,
and a loss scale whose ranks agree on overflow), ``compute_gradients`` (tf_keras: the reduction where
the gradients are computed, and the local passes), ``batch_norm`` (``SyncBatchNormalization``: the
global batch's moments). It imports no Keras itself: the front's module is the argument.
"""
