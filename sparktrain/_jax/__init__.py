"""The Horovod-on-Keras implementation for Keras 3 on JAX, beside ``sparktrain._keras`` (the one on
TensorFlow); ``sparktrain.keras.fronts.jax`` and ``sparktrain.jax`` are its fronts.

``env`` (the rank's environment for JAX and XLA: pure, imports no JAX, so the executor uses it),
``distributed`` (``jax.distributed`` and device meshes from that environment), ``backend`` (``init``,
who the rank is, what only TensorFlow has, and the callbacks' :class:`~sparktrain._jax.backend.JaxBackend`),
``collectives`` (the native engine's communicator and the reductions inside a compiled step),
``ffi`` (the engine's XLA FFI handlers), ``optimizer`` (``DistributedOptimizer``) and ``callbacks``
(the broadcast). Nothing here imports TensorFlow; an import-linter contract says so.
"""
