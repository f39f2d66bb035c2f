"""What both fronts on TensorFlow (Keras 3 and tf_keras) export as Horovod's ``horovod.tensorflow.keras``
does: ``sparktrain.tensorflow``'s collectives, process sets and build facts. An older TensorFlow fails
in ``sparktrain.tensorflow``'s import, with the version and the fix."""
from __future__ import annotations

from ...tensorflow import (Average, Compression, ProcessSet, Sum, add_process_set, allgather, allreduce,  # noqa: F401
                           broadcast, broadcast_variables, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                           global_process_set, gloo_built, gloo_enabled, init, is_initialized, local_rank, local_size,
                           mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter,
                           remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)

__all__ = ["Average", "Compression", "ProcessSet", "Sum", "add_process_set", "allgather", "allreduce", "broadcast",
           "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
           "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline"]
