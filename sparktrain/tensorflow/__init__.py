"""TensorFlow collectives across the ranks of ``sparktrain.run``: Horovod's ``horovod.tensorflow``.

Inside ``train_fn``::

    import sparktrain.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([hvd.rank()]), op=hvd.Sum)

On GPU the collectives are TensorFlow's own (``CollectiveReduceV2`` and friends) over NCCL. On
CPU they run on sparktrain's native engine (``sparktrain.engine``: shared memory within a host,
a TCP ring between hosts), called through sparktrain's TensorFlow kernels, compiled at first use
(one ``tf.numpy_function`` per collective where they cannot be built), so they work eagerly,
inside ``model.fit``'s compiled step and in ``tf.compat.v1`` graphs alike. ``SPARKTRAIN_CPU_COLLECTIVES`` /
``spark.sparktrain.cpuCollectives=tensorflow`` chooses TensorFlow's gRPC ring instead, as does
a build without the engine (with one warning). ``init`` brings the chosen runtime up from the
``TF_CONFIG`` that ``run`` wrote; :func:`collective_engine` says which it is.

The package, by role: ``runtime`` (init, shutdown, rank and size, what was built, and the
backend the collectives run on, chosen once), ``ops`` (the reductions), ``compression``,
``collectives`` (allreduce, allgather, broadcast and their gradients), ``process_sets``
(collectives over some of the ranks), ``scatter``
(reducescatter, alltoall) and ``variables`` (variables from the root rank), over ``backends``
(one rank; the native engine through TensorFlow kernels or ``hostops``; TensorFlow's
``ringops``), ``objects`` (Python objects),
``gradients`` (gradient reduction and the gradient tapes) and ``timeline``. Horovod's
``DistributedOptimizer`` (for Keras optimizers) and ``SyncBatchNormalization`` serve Keras objects:
``keras_names`` hands them to the front of their Keras line (``sparktrain.kerasline``) when called or
asked for; this layer imports nothing of the Keras layer.
"""
from __future__ import annotations

from ..seam.versions import require_floor

require_floor("tensorflow")  # an older TensorFlow fails here, with the version found and the fix


def _left_alone_by_autograph() -> None:
    """AutoGraph calls sparktrain's functions as they are, as it calls TensorFlow's and Keras':
    they are written for graphs already. Converted, each cost its process the parsing and
    rewriting of its source the first time a ``tf.function`` called it. TensorFlow keeps the
    packages it leaves alone in a private list; where that list moves, only the cost comes back."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return
    if not any(getattr(rule, "_prefix", None) == "sparktrain" for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert("sparktrain"), *config.CONVERSION_RULES)


_left_alone_by_autograph()

from .collectives import allgather, allreduce, barrier, broadcast, grouped_allgather, grouped_allreduce, join
from .compression import Compression
from . import keras_names
from .keras_names import DistributedOptimizer
from .gradients import (DistributedGradientTape, PartialDistributedGradientTape, allreduce_gradients,
                        average_gradients, reduce_except_local)
from .objects import allgather_object, broadcast_object, broadcast_object_fn
from .ops import (Adasum, Average, Max, Min, Product, Sum, check_num_rank_power_of_2, check_op,
                  handle_average_backwards_compatibility)
from .process_sets import (ProcessSet, add_process_set, global_process_set, process_set_included_op,
                           remove_process_set, size_op)
from .scatter import alltoall, grouped_reducescatter, reducescatter
from .runtime import (COLLECTIVE_TIMEOUT_ENV, DEFAULT_TIMEOUT, ccl_built, collective_engine, collective_kernels,
                      cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
                      is_initialized, local_rank, local_rank_op, local_size, local_size_op, mpi_built, mpi_enabled, mpi_threads_supported,
                      nccl_built, rank, rank_op, rocm_built, shutdown, size,
                      strategy)
from .runtime import cpu_engine as _cpu_engine  # noqa: F401 - the settings tests ask it directly
from .timeline import start_timeline, stop_timeline
from .variables import broadcast_, broadcast_global_variables, broadcast_variables

__all__ = [
    "Adasum", "Average", "COLLECTIVE_TIMEOUT_ENV", "Compression", "DEFAULT_TIMEOUT", "DistributedGradientTape",
    "DistributedOptimizer", "Max",
    "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_object", "allreduce", "allreduce_gradients", "alltoall", "average_gradients", "barrier", "broadcast",
    "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_num_rank_power_of_2", "check_op",
    "collective_engine", "collective_kernels", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
    "reduce_except_local", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline", "strategy",
]


def __getattr__(name):
    # ``hvd.elastic`` as in Horovod, without importing it (and storage) for every rank.
    if name == "elastic":
        import importlib

        return importlib.import_module(f"{__name__}.elastic")
    # Horovod exports it here too; it is the Keras layer's, and imports Keras: only when asked for.
    if name == "SyncBatchNormalization":
        return keras_names.sync_batch_normalization()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
