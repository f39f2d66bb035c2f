"""``sparktrain.keras`` on Keras' JAX backend (``run(..., backend="jax")``): what keeps its meaning.

Who the rank is, ``init`` (``keras.distribution.initialize()`` and the native engine's
communicator, once), ``DistributedOptimizer`` (``jax_optimizer``), the broadcast and metric-average
callbacks, saving from rank 0 and the checkpoint and tracking callbacks work as on TensorFlow. What
only exists on the TensorFlow backend (Horovod's tensor collectives, ``PartialDistributedOptimizer``,
``SyncBatchNormalization``) raises and names ``keras.distribution``. No TensorFlow is imported here.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .. import context, kerasline
from ..jax import coordinator, not_on_jax

#: What ``sparktrain.keras`` offers on TensorFlow only; on JAX each name raises when called.
TENSORFLOW_ONLY = (
    "PartialDistributedOptimizer", "SyncBatchNormalization", "allreduce", "allgather",
    "broadcast", "broadcast_variables", "broadcast_global_variables", "reducescatter", "add_process_set",
    "remove_process_set", "start_timeline", "stop_timeline",
)


#: Whether this process's Keras runs on JAX (``kerasline.on_jax``).
on_jax = kerasline.on_jax


def refuse_on_jax(what: str) -> None:
    """Raise :func:`sparktrain.jax.not_on_jax`'s error for ``what`` when Keras runs on JAX."""
    if on_jax():  # keras.distribution starts every process from the same seed and averages on its own
        raise not_on_jax(f"sparktrain.keras.{what}")


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Around a save that one rank makes alone: on JAX, with no distribution set, so that nothing it
    does places values across the processes (a collective the other ranks would never join, which
    fails them all); elsewhere nothing."""
    if not on_jax():
        yield
        return
    import keras

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


def refuse(name: str):
    """A stand-in for ``name`` that raises :func:`sparktrain.jax.not_on_jax`'s error when called."""

    def tensorflow_only(*args, **kwargs):
        raise not_on_jax(f"sparktrain.keras.{name}")

    tensorflow_only.__name__ = tensorflow_only.__qualname__ = name
    tensorflow_only.__doc__ = "On the TensorFlow backend only; on JAX it raises (use keras.distribution)."
    return tensorflow_only


def init(timeout: float | None = None, **kwargs) -> None:
    """``keras.distribution.initialize()`` from the rank's environment, once per process, and the
    native engine's communicator, which ``DistributedOptimizer`` and the callbacks use; outside a
    JAX run (no coordinator in the environment) nothing, as one process. ``timeout`` and the other
    Horovod arguments are accepted and not used: JAX's own initialization timeout applies.
    """
    import jax
    import keras

    from . import jax_engine

    if coordinator() is None:
        return
    if not jax.distributed.is_initialized():
        keras.distribution.initialize()
    jax_engine.start()


def is_initialized() -> bool:
    import jax

    return jax.distributed.is_initialized()


def shutdown() -> None:
    """Close the native engine's communicator (JAX's processes part when they exit)."""
    from . import jax_engine

    jax_engine.stop()


rank, size, local_rank, local_size = context.rank, context.size, context.local_rank, context.local_size
cross_rank, cross_size = context.cross_rank, context.cross_size
