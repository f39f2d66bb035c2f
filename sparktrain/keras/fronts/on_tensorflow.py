"""What both fronts on TensorFlow (Keras 3 and tf_keras) share: what they export as Horovod's
``horovod.tensorflow.keras`` does (``sparktrain.tensorflow``'s collectives, process sets and build
facts), and :class:`TensorFlowBackend`, the callbacks' collectives on TensorFlow. An older TensorFlow
fails in ``sparktrain.tensorflow``'s import, with the version and the fix."""
from __future__ import annotations

from ..._keras.backend import Backend, optimizer_variables
from ...errors import InvalidArgumentError
from ...tensorflow.collectives import allgather, allreduce, barrier, broadcast  # noqa: F401
from ...tensorflow.compression import Compression  # noqa: F401
from ...tensorflow.ops import Average, Sum  # noqa: F401
from ...tensorflow.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                        remove_process_set)
from ...tensorflow.runtime import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,  # noqa: F401
                                   gloo_enabled, init, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from ...tensorflow.scatter import reducescatter  # noqa: F401
from ...tensorflow.timeline import start_timeline, stop_timeline  # noqa: F401
from ...tensorflow.variables import broadcast_variables  # noqa: F401

__all__ = ["Average", "Compression", "ProcessSet", "Sum", "add_process_set", "allgather", "allreduce", "broadcast",
           "broadcast_global_variables", "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
           "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline"]


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1 call, which TensorFlow 2 has no meaning for: there is no global collection of
    variables to broadcast. As Horovod does under TensorFlow 2, this raises and names what to use.
    """
    raise InvalidArgumentError(
        f"broadcast_global_variables({root_rank!r}) has no meaning in TensorFlow 2 (there are no global "
        "variables); use callbacks.BroadcastGlobalVariablesCallback(root_rank) with model.fit, or "
        "broadcast_variables(model.variables + optimizer.variables, root_rank) in a custom loop")


class TensorFlowBackend(Backend):
    """The callbacks' collectives on TensorFlow (``sparktrain.tensorflow``), for Keras 3 or tf_keras."""

    def ready(self) -> None:
        init()

    def prepare(self, model) -> None:
        from ..._keras.update_step import agree_on_overflow

        init()
        agree_on_overflow(model)

    def gather_ints(self, value: int) -> list[int]:
        import tensorflow as tf

        return [int(s) for s in allgather(tf.constant([value], tf.int64)).numpy()]

    def average_floats(self, values: list[float]) -> list[float]:
        import tensorflow as tf

        return allreduce(tf.constant(values, tf.float64), op=Average).numpy().tolist()

    def broadcast_model(self, model, root_rank: int, with_optimizer: bool, local: dict) -> None:
        # A model given no input shape (Horovod's MNIST example builds one so) is built by its first
        # batch; tf_keras refuses to list its weights before. Its broadcast waits for that batch's end,
        # as Horovod's always did.
        if not with_optimizer and not getattr(model, "built", True):
            return
        from ..._keras.reduction import local_variables

        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + (optimizer_variables(optimizer) if with_optimizer else [])
        skip = set(local) | {id(v) for v in local_variables(optimizer)}
        broadcast_variables([v for v in variables if id(v) not in skip], root_rank)

    def is_variable(self, v) -> bool:
        """Whether ``v`` is a variable of this Keras or of TensorFlow."""
        import tensorflow as tf

        if isinstance(v, tf.Variable):
            return True
        variable = getattr(self.keras, "Variable", None)  # Keras 3 only
        # A layer's variables are the backend's Variable class: keras.Variable itself from Keras 3.6
        # or so, its base before (3.2-3.5 export a subclass of it as keras.Variable). The class right
        # after keras.Variable in its MRO is that backend class in every release.
        return variable is not None and isinstance(v, (variable.__mro__[1], variable))

    def barrier(self) -> None:
        barrier()

    def variable_values(self, variables) -> list:
        from ...tensorflow.elastic import variable_values

        return variable_values(variables)

    def assign_variables(self, variables, values, what: str) -> None:
        from ...tensorflow.elastic import assign_variables

        assign_variables(variables, values, what)

    def backend_requirements(self) -> list[str]:
        import tensorflow

        return [f"tensorflow=={tensorflow.__version__}"]

