"""What both fronts on TensorFlow (Keras 3 and tf_keras) export as Horovod's ``horovod.tensorflow.keras``
does: ``sparktrain.tensorflow``'s collectives, process sets and build facts. An older TensorFlow fails
in ``sparktrain.tensorflow``'s import, with the version and the fix."""
from __future__ import annotations

from ...tensorflow.collectives import allgather, allreduce, broadcast  # noqa: F401
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
           "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
           "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline"]
