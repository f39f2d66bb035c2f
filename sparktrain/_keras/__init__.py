"""The Horovod-on-Keras implementation, written once for every front: each piece takes the Keras module
(and what differs between the fronts) from the front that binds it (``sparktrain.keras.fronts``).

``backend`` (a front's Keras and collectives as the callbacks use them, and how the callbacks are built
over its Keras ``Callback``), the callbacks' implementations (``callbacks``: broadcast and metric
average; ``schedules``, ``checkpoints``, ``backup``, ``tracking``; ``elastic``, on TensorFlow), and on
TensorFlow: ``optimizer`` (``DistributedOptimizer``, ``PartialDistributedOptimizer``, ``load_model``,
and the :class:`~sparktrain._keras.optimizer.Line` a front gives them), ``reduction`` (Horovod's
arguments checked, and the gradients reduced), ``update_step`` (Keras 3: the reduction inside the
update step, and a loss scale whose ranks agree on overflow), ``compute_gradients`` (tf_keras: the
reduction where the gradients are computed, and the local passes), ``batch_norm``
(``SyncBatchNormalization``: the global batch's moments). It imports no Keras itself: the front's
module is the argument; the callbacks' rooms import no TensorFlow, so a JAX rank builds them too.
"""
