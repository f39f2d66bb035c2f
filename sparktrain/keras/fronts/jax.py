"""Keras 3 on JAX (``run(..., backend="jax")``): what keeps its meaning, with no TensorFlow imported.

Who the rank is, ``init``, ``DistributedOptimizer`` and ``load_model`` (Keras's own) work as on
TensorFlow, each handing its call to the JAX implementation (``sparktrain._jax``); what only exists
on the TensorFlow backend (Horovod's tensor collectives, process sets, timeline and build facts,
``PartialDistributedOptimizer``, ``SyncBatchNormalization``) raises when called, and names
``keras.distribution``.
"""
from __future__ import annotations

from ...seam.versions import require_keras_3

require_keras_3()  # before Keras is imported: Keras 2 fails here at once
import keras  # noqa: E402

from ... import context, kerasline  # noqa: E402
from ..._jax import backend as _backend, optimizer as _optimizer  # noqa: E402

#: The reduction ops and compressions of the JAX ``DistributedOptimizer``.
Average, Sum, Compression = _optimizer.Average, _optimizer.Sum, _optimizer.Compression
#: JAX ranks have no process sets: every rank reduces together (``process_set=None``).
global_process_set = None

def init(timeout: float | None = None, **kwargs) -> None:
    """``keras.distribution.initialize()`` from the rank's environment, once per process, and the
    native engine's communicator, which ``DistributedOptimizer`` and the callbacks use; outside a
    JAX run nothing, as one process. ``timeout`` and Horovod's other arguments are accepted and not
    used: JAX's own initialization timeout applies."""
    _backend.init(timeout, **kwargs)

def is_initialized() -> bool:
    """Whether JAX's processes are initialized (``jax.distributed``)."""
    return _backend.is_initialized()

def shutdown() -> None:
    """Close the native engine's communicator (JAX's processes part when they exit)."""
    _backend.shutdown()

def rank() -> int:
    """This rank (``sparktrain.rank()``)."""
    return context.rank()

def size() -> int:
    """The number of ranks (``sparktrain.size()``)."""
    return context.size()

def local_rank() -> int:
    """This rank's index among the run's ranks on its host."""
    return context.local_rank()

def local_size() -> int:
    """The number of the run's ranks on this host."""
    return context.local_size()

def cross_rank() -> int:
    """This host's index among the hosts that run a rank with this local rank."""
    return context.cross_rank()

def cross_size() -> int:
    """The number of hosts that run a rank with this local rank."""
    return context.cross_size()

def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    return _optimizer.DistributedOptimizer(optimizer, *args, **kwargs)

DistributedOptimizer.__doc__ = _optimizer.DistributedOptimizer.__doc__

def load_model(filepath: str, custom_optimizers=None, custom_objects=None, compression=None, **kwargs):
    """``keras.models.load_model``: on JAX keras.distribution does the reduction, so the optimizer
    comes back as it was saved."""
    return keras.models.load_model(filepath, custom_objects=custom_objects, **kwargs)

# On the TensorFlow backend only: each raises when called, naming keras.distribution.
PartialDistributedOptimizer = _backend.refuse("PartialDistributedOptimizer")
SyncBatchNormalization = _backend.refuse("SyncBatchNormalization")
ProcessSet = _backend.refuse("ProcessSet")
allreduce = _backend.refuse("allreduce")
allgather = _backend.refuse("allgather")
broadcast = _backend.refuse("broadcast")
reducescatter = _backend.refuse("reducescatter")
broadcast_variables = _backend.refuse("broadcast_variables")
broadcast_global_variables = _backend.refuse("broadcast_global_variables")
add_process_set = _backend.refuse("add_process_set")
remove_process_set = _backend.refuse("remove_process_set")
start_timeline = _backend.refuse("start_timeline")
stop_timeline = _backend.refuse("stop_timeline")
mpi_built = _backend.refuse("mpi_built")
mpi_enabled = _backend.refuse("mpi_enabled")
mpi_threads_supported = _backend.refuse("mpi_threads_supported")
gloo_built = _backend.refuse("gloo_built")
gloo_enabled = _backend.refuse("gloo_enabled")
nccl_built = _backend.refuse("nccl_built")
ddl_built = _backend.refuse("ddl_built")
ccl_built = _backend.refuse("ccl_built")
cuda_built = _backend.refuse("cuda_built")
rocm_built = _backend.refuse("rocm_built")

#: The callbacks' backend: the native engine on host arrays.
BACKEND = _backend.JaxBackend(keras, kerasline.KERAS_3)

__all__ = ["Average", "Compression", "DistributedOptimizer", "Sum", "cross_rank", "cross_size",
           "global_process_set", "init", "is_initialized", "load_model", "local_rank", "local_size", "rank",
           "shutdown", "size", *_backend.TENSORFLOW_ONLY]
