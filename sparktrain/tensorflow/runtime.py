"""The collective runtime of one rank: which engine runs the collectives, its state, and the
queries Horovod offers about it (rank, size, what it was built with).

``init`` brings the chosen engine up from the env ``sparktrain.run`` wrote: on GPU TensorFlow's
own collectives over NCCL; on CPU sparktrain's native engine, or TensorFlow's gRPC ring with
``SPARKTRAIN_CPU_COLLECTIVES=tensorflow`` (or where the engine was not built). On the native
engine it makes the communicator the process's current one and loads sparktrain's TensorFlow
kernels (``kernels``: compiled the first time, then cached; ``tf.numpy_function`` where they
cannot be built), which find the communicator at run time; ``shutdown`` clears it.
"""
from __future__ import annotations

import logging
import os
import threading

from .. import context as _ctx
from ..settings import rank as rank_settings
from .. import settings
from ..errors import InvalidArgumentError, SparkTrainError

#: Default seconds a collective may wait for its peers before failing (DeadlineExceeded).
DEFAULT_TIMEOUT = settings.SETTINGS["collective_timeout"].default
COLLECTIVE_TIMEOUT_ENV = settings.SETTINGS["collective_timeout"].env

# Keys far from the ones MultiWorkerMirroredStrategy hands out for its own collectives.
GROUP_KEY = 0x5A17
_FIRST_INSTANCE_KEY = 1 << 20


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.initialized = False
        self.size = 1
        self.rank = 0
        self.gpu = False
        self.timeout = DEFAULT_TIMEOUT
        self.strategy = None
        self.next_key = _FIRST_INSTANCE_KEY
        #: "native", "tensorflow" or "nccl"; the native engine's communicator when native.
        self.engine = None
        self.comm = None
        #: Whether the native engine's collectives run as TensorFlow kernels (``kernels``).
        self.kernels = False
        #: Where the collectives run (``backends.NAMES``), chosen by ``init()``.
        self.backend = "single"


state = _State()

#: What ``process_sets`` does at ``init`` (``check`` its ``process_sets`` first, ``start`` them
#: once the engine is up) and at ``shutdown`` (``stop``: close every set); set when it is imported.
hooks: dict = {}


def _tf():
    import tensorflow as tf

    return tf


def init(timeout: float | None = None, comm=None, process_sets=None) -> None:
    """Bring up the collective runtime among the ranks. Idempotent; call it first in ``train_fn``.

    Parameters
    ----------
    timeout : seconds a collective may wait for the other ranks before it fails, so that a rank
        that died or hangs never blocks the others for ever. Default: ``SPARKTRAIN_COLLECTIVE_TIMEOUT``
        or 600.
    comm : Horovod's MPI communicator, accepted at its default (None) only: sparktrain's ranks are
        the run's.
    process_sets : a list of ``ProcessSet`` to register once the engine is up (see
        ``add_process_set``; every rank passes the same list), ``"dynamic"`` or None: none now
        (``add_process_set`` may add them later either way).

    It may be called first eagerly, inside a ``tf.function`` or in a graph: the runtime is always
    brought up eagerly, so later eager collectives find it. On GPU, the rank sees exactly the one
    GPU ``run`` pinned for it (``CUDA_VISIBLE_DEVICES``) and memory growth is turned on.
    """
    if comm is not None:
        raise InvalidArgumentError(f"init(comm={comm!r}): sparktrain has no MPI communicators; its ranks are the "
                                   "run's processes. Call init() without comm")
    if "check" in hooks:
        hooks["check"](process_sets)
    with state.lock:
        if not state.initialized:
            timeout = rank_settings.current().collective_timeout if timeout is None else \
                settings.parse_value("collective_timeout", timeout)
            tf = _tf()
            # Inside a tf.function (or a graph) the strategy below would be built in that graph, and
            # later eager collectives would find no runtime: bring everything up eagerly instead.
            with tf.init_scope():
                _bring_up(tf, float(timeout))
            state.initialized = True
            path = rank_settings.current().timeline
            if path:  # SPARKTRAIN_TIMELINE: Horovod's HOROVOD_TIMELINE
                from .timeline import active, start_timeline

                if not active():
                    start_timeline(path)
    if process_sets and "start" in hooks:
        hooks["start"](process_sets)


def _bring_up(tf, timeout: float) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # already initialized (init again after shutdown): keeps its setting
            pass
    state.gpu = bool(gpus)
    state.size = _ctx.size()
    state.rank = _ctx.rank()
    state.timeout = timeout
    state.engine = "nccl" if state.gpu else cpu_engine()
    if state.size > 1 and state.engine == "native":
        from .. import engine

        state.comm = engine.from_env(state.timeout)
        state.comm.make_current()  # where the TensorFlow kernels find it
        from . import kernels

        state.kernels = kernels.load() is not None
        kernels.set_timeout(state.timeout)  # how long TensorFlow 1 graph collectives may agree on nothing
    elif state.size > 1 and state.strategy is None:  # after shutdown the server is still up
        if "TF_CONFIG" not in os.environ:
            raise SparkTrainError("TF_CONFIG is not set: sparktrain.tensorflow.init() must run inside sparktrain.run")
        # Constructing the strategy is TensorFlow's supported way to start this process's
        # server from TF_CONFIG and configure the collective runtime (NCCL or ring). Keras 3
        # models are not placed under its scope: the collectives are issued directly.
        _configure_health_checks(state.timeout)
        impl = (tf.distribute.experimental.CommunicationImplementation.NCCL if state.gpu
                else tf.distribute.experimental.CommunicationImplementation.RING)
        # No timeout_seconds here: TensorFlow starts a thread per collective call that
        # sleeps out the timeout, so a per-step timeout piles up threads until the process
        # crashes.
        options = tf.distribute.experimental.CommunicationOptions(implementation=impl)
        state.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    # The collectives' backend, chosen here once (see ``backends``), not in every collective.
    state.backend = ("single" if state.size == 1 else "kernels" if state.kernels else
                     "numpy" if state.comm is not None else "ring")


def shutdown() -> None:
    """Close this rank's collective engine; ``init()`` may bring it up again.

    Every rank should shut down together, as with Horovod. On the native engine the
    communicator is closed (its shared memory and connections released) and a later ``init``
    connects anew. TensorFlow's runtime cannot stop its server, so there ``shutdown`` only
    marks the rank uninitialized and ``init`` reuses the server.
    """
    with state.lock:
        if "stop" in hooks:
            hooks["stop"]()  # every process set's communicator, before the global one
        if state.comm is not None:
            if state.kernels:
                from . import kernels

                kernels.stop_sequencer()  # fails the TensorFlow 1 graph collectives still waiting
            state.comm.close()  # clears the current communicator first, waiting for a kernel in flight
            state.comm = None
        state.kernels = False
        state.backend = "single"
        state.initialized = False


def cpu_engine() -> str:
    """The CPU engine the settings ask for, or TensorFlow's ring (with one warning) where the
    native engine is not available."""
    wanted = rank_settings.current().cpu_collectives
    if wanted == "tensorflow":
        return "tensorflow"
    from .. import engine

    if engine.available():
        return "native"
    logging.getLogger(__name__).warning("%s; using TensorFlow's ring for collectives on CPU instead",
                                        engine.unavailable_reason())
    return "tensorflow"


def collective_engine() -> str:
    """Which engine runs this rank's collectives: ``"native"``, ``"tensorflow"`` or ``"nccl"``.

    >>> hvd.init(); hvd.collective_engine()  # doctest: +SKIP
    'native'
    """
    require_init()
    return state.engine


def collective_kernels() -> bool:
    """Whether this rank's collectives run as sparktrain's TensorFlow kernels over the native
    engine (``sparktrain.tensorflow.kernels``), rather than through ``tf.numpy_function``;
    False on the other engines.

    >>> hvd.init(); hvd.collective_kernels()  # doctest: +SKIP
    True
    """
    require_init()
    return bool(state.kernels)


def _configure_health_checks(timeout: float) -> None:
    """Make the runtime's peer health check notice a dead or frozen rank within about ``timeout``.

    The strategy pings every peer on a background thread and aborts all collectives when one
    stops answering; that is what bounds collectives inside ``tf.function`` (see ``op_timeout``).
    """
    try:
        from tensorflow.python.distribute import collective_all_reduce_strategy as cars

        ext = cars.CollectiveAllReduceExtended
        # Three attempts of check_timeout each, every interval: detection within ~timeout.
        ext._check_health_timeout = max(1, int(timeout / 6))
        ext._check_health_interval = max(1, int(timeout / 2))
        ext._check_health_initial_timeout = max(1, int(timeout))  # every rank must reach init() by then
    except (ImportError, AttributeError):  # a TensorFlow without these knobs keeps its defaults
        pass


def op_timeout() -> float:
    """The per-op timeout of TensorFlow's collectives: the collective timeout when eager, none
    inside ``tf.function``.

    TensorFlow implements an op's timeout with a thread that sleeps it out, one per call; per
    training step that leaks threads until the process dies. Inside functions (every training
    step) the runtime's health check bounds the wait instead.
    """
    return state.timeout if _tf().executing_eagerly() else 0.0


def require_init() -> None:
    if not state.initialized:
        raise SparkTrainError("call sparktrain.tensorflow.init() (or sparktrain.keras.init()) first")


def next_key() -> int:
    """The next instance key of TensorFlow's collectives: the same sequence on every rank."""
    with state.lock:
        key = state.next_key
        state.next_key += 1
    return key


def strategy():
    """A MultiWorkerMirroredStrategy wired from the run's env, for tf_keras (``TF_USE_LEGACY_KERAS=1``).

    Keras 3 does not support this strategy (``model.fit`` fails with "Attempt to convert a value
    (PerReplica...)"); use ``sparktrain.keras.DistributedOptimizer`` there. Under the strategy,
    tf_keras runs collectives inside ``model.save`` too, so every rank must call it.
    """
    init()
    if state.strategy is None:
        state.strategy = _tf().distribute.MultiWorkerMirroredStrategy()
    return state.strategy


# -- who am I ----------------------------------------------------------------------------------

def rank() -> int:
    """This process's rank."""
    return _ctx.rank()


def size() -> int:
    """The number of ranks."""
    return _ctx.size()


def local_rank() -> int:
    """This process's index among the ranks on its host."""
    return _ctx.local_rank()


def local_size() -> int:
    """The number of ranks on this host."""
    return _ctx.local_size()


def cross_rank() -> int:
    """This host's index among the hosts that run a rank with this local rank."""
    return _ctx.cross_rank()


def cross_size() -> int:
    """The number of hosts that run a rank with this local rank."""
    return _ctx.cross_size()


def _int_op(value: int):
    tf = _tf()
    with tf.init_scope():  # a constant of the launch, captured by functions like any other
        return tf.constant(value, tf.int32)


def rank_op(name: str | None = None):
    """:func:`rank` as an int32 tensor (Horovod's ``rank_op``)."""
    return _tf().identity(_int_op(rank()), name=name)


def local_rank_op(name: str | None = None):
    """:func:`local_rank` as an int32 tensor."""
    return _tf().identity(_int_op(local_rank()), name=name)


def local_size_op(name: str | None = None):
    """:func:`local_size` as an int32 tensor."""
    return _tf().identity(_int_op(local_size()), name=name)


def is_initialized() -> bool:
    """Whether ``init`` ran (and no ``shutdown`` since)."""
    return state.initialized


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks.

    Read from the run's rendezvous (``TF_CONFIG`` lists every rank's host), so every rank gives
    the same answer; without it (a run of one), from this host's share of the ranks.
    """
    import json

    try:
        workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    except (KeyError, ValueError, TypeError):
        return cross_size() * local_size() == size()
    per_host: dict = {}
    for w in workers:
        host = w.rsplit(":", 1)[0]
        per_host[host] = per_host.get(host, 0) + 1
    return len(set(per_host.values())) == 1


# What this build has, in Horovod's terms: no MPI, Gloo, DDL, oneCCL or ROCm; NCCL and CUDA are
# TensorFlow's own, present when TensorFlow was built with CUDA.

def mpi_built() -> bool:
    """False: sparktrain runs without MPI."""
    return False


def mpi_enabled() -> bool:
    """False: sparktrain runs without MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI. (Collectives may be issued from any one thread at a time.)"""
    return False


def gloo_built() -> bool:
    """False: sparktrain's CPU collectives are its own engine, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: sparktrain's CPU collectives are its own engine, not Gloo."""
    return False


def nccl_built() -> bool:
    """Whether GPU collectives can use NCCL: TensorFlow's, present in its CUDA builds."""
    return cuda_built()


def cuda_built() -> bool:
    """Whether TensorFlow was built with CUDA."""
    return bool(_tf().test.is_built_with_cuda())


def rocm_built() -> bool:
    """Whether TensorFlow was built with ROCm."""
    return bool(_tf().test.is_built_with_rocm())


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False
