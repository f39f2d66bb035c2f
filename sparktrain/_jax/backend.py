"""``sparktrain.keras`` on Keras' JAX backend (``run(..., backend="jax")``): what keeps its meaning.

Who the rank is and ``init`` (``keras.distribution.initialize()`` and the native engine's
communicator, once) work as on TensorFlow, and :class:`JaxBackend` gives the broadcast and
metric-average callbacks their collectives. What only exists on the TensorFlow backend (Horovod's
tensor collectives, ``PartialDistributedOptimizer``, ``SyncBatchNormalization``) raises when called
and names ``keras.distribution`` (:func:`refuse`). No TensorFlow is imported here.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .._keras.backend import Backend
from ..errors import SparkTrainError
from .env import coordinator

#: What ``sparktrain.keras`` offers on TensorFlow only; on JAX each name raises when called.
TENSORFLOW_ONLY = (
    "PartialDistributedOptimizer", "SyncBatchNormalization", "ProcessSet", "allreduce", "allgather",
    "broadcast", "broadcast_variables", "broadcast_global_variables", "reducescatter", "add_process_set",
    "remove_process_set", "start_timeline", "stop_timeline", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
)


def not_on_jax(what: str) -> SparkTrainError:
    """The error of a TensorFlow-only part of the API called on the JAX backend."""
    return SparkTrainError(
        f"{what} works on the TensorFlow backend only; this rank runs Keras on JAX. On JAX, "
        "keras.distribution does the collectives: keras.distribution.initialize(), then "
        "keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False)) "
        "(docs/jax.md)")


def refuse(name: str):
    """A stand-in for ``name`` that raises :func:`not_on_jax`'s error when called."""

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

    from . import collectives

    if coordinator() is None:
        return
    if not jax.distributed.is_initialized():
        keras.distribution.initialize()
    collectives.start()


def is_initialized() -> bool:
    import jax

    return jax.distributed.is_initialized()


def shutdown() -> None:
    """Close the native engine's communicator (JAX's processes part when they exit)."""
    from . import collectives

    collectives.stop()


class JaxBackend(Backend):
    """The callbacks' backend on Keras 3's JAX backend: the native engine on host arrays
    (``callbacks``); keras.distribution averages the gradients and the metrics itself."""

    metrics_are_global = True
    keras_distribution = True
    local_variables = False
    elastic = False

    def gather_ints(self, value: int) -> list[int]:
        from . import collectives

        return collectives.gather_ints(value)

    def average_floats(self, values: list[float]) -> list[float]:
        from . import collectives

        return list(collectives.average_floats(values))

    def broadcast_model(self, model, root_rank: int, with_optimizer: bool, local: dict) -> None:
        from .callbacks import broadcast_model

        broadcast_model(model, root_rank, with_optimizer=with_optimizer)

    def refuse(self, what: str) -> None:
        # keras.distribution starts every process from the same seed and averages on its own
        raise not_on_jax(f"sparktrain.keras.{what}")

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """With no distribution set, so that nothing a save that one rank makes alone does places
        values across the processes (a collective the other ranks would never join, which fails
        them all)."""
        keras = self.keras
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            yield
        finally:
            keras.distribution.set_distribution(distribution)

    def with_weights(self, model, filepath: str, custom_objects=None):
        """A copy of ``model`` that this process holds alone, outside the run's distribution, with
        the weights at ``filepath``. The run's variables are placed across every process, and
        assigning one a value is a collective (JAX checks that every process gives the same value)
        that the ranks which do not load never join; the copy's variables are this process's own."""
        import os
        import tempfile

        with self.saving(), tempfile.TemporaryDirectory(prefix="sparktrain-alone-") as tmp:
            copy = os.path.join(tmp, "model.keras")
            model.save(copy)  # reads the replicated values from this process's devices
            alone = self.keras.saving.load_model(copy, custom_objects=custom_objects)
            alone.load_weights(filepath)
        return alone

    def backend_requirements(self) -> list[str]:
        from importlib.metadata import version

        return [f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}"]
