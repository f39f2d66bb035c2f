"""What crosses the seam between the driver and the ranks. Pure: shared by both sides.

Down: the :class:`TaskSpec` each barrier task carries. Up: the rows the barrier stage returns
(rank 0's pickled value in chunks, :data:`RESULT_SCHEMA`), whose first chunk starts with
:data:`SPILLED` when the value went to storage instead.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything a rank needs from the driver. Shipped inside the Spark task closure."""

    run_id: str
    size: int
    payload: bytes
    secret: bytes
    #: The driver channel's address; None when ranks rendezvous with a Spark allGather instead.
    driver_address: tuple[str, int] | None
    use_gpu: bool
    output_ranks: frozenset[int] | None
    #: Largest pickled result rank 0 may return through Spark; 0 means no limit.
    max_result_bytes: int
    start_timeout: float
    grace_period: float
    #: Not in the repr: it may hold tokens.
    user_env: dict[str, str] = dataclasses.field(repr=False)
    #: ``checkpoint_url`` when rank 0's value goes to storage (with :attr:`storage_options`).
    checkpoint: str | None = None
    #: Where rank 0 spills a value too large for Spark's result path (``spill_url`` setting).
    spill_url: str | None = None
    #: Which attempt of the run this is, 1-based.
    attempt: int = 1
    #: How many attempts the run has in all.
    max_attempts: int = 1
    #: The driver's versions (see ``sparktrain.seam.versions``); each rank checks its own against them.
    versions: dict | None = None
    #: ``TF_CPP_MIN_LOG_LEVEL`` for ranks whose environment does not set it (0 shows every C++ line).
    tf_log_level: int = 2
    #: The names of the DataFrames fed to the run (``run(..., data=...)``), in the order the stage's
    #: input numbers them; empty when no data is fed.
    feed: tuple[str, ...] = ()
    #: The fed DataFrames the ranks read from their Parquet files instead, as ``(name, data.scan.Scan)``:
    #: every row group of each; each rank reads its share (``data.scan.split``) and no stage carries them.
    scans: tuple = dataclasses.field(default=(), repr=False)
    #: Send each rank's output tail back with the result: the client cannot be reached for live
    #: output (Spark Connect, ranks meeting through the barrier allGather).
    return_output: bool = False
    #: ``log_url`` when ranks write their output to storage too (``sparktrain.storage.outputlog``,
    #: with :attr:`storage_options`).
    log_target: str | None = None
    #: ``run(..., storage_options=)`` cloudpickled, the one copy the ranks get: the run's home, rank
    #: 0's ``checkpoint_url``, the ``log_url`` and the files of a fed scan all use it
    #: (``sparktrain.storage.rank``). None: the store's credentials from each process's environment.
    #: Not in the repr: it may hold credentials.
    storage_options: bytes | None = dataclasses.field(default=None, repr=False)
    #: The CPU cores each rank's task holds (its resource profile's, or ``spark.task.cpus``); the rank's
    #: compute threads follow it (``host.cpus.rank_threads``). None: this host's cores shared among its ranks.
    task_cpus: int | None = None
    #: The driver's MLflow hand-off for rank 0 (see ``sparktrain.seam.tracking``); not in the repr: it holds tokens.
    mlflow: dict | None = dataclasses.field(default=None, repr=False)
    #: Seconds of silence on the channel after which a rank counts the driver as gone (0: never).
    heartbeat_timeout: float = 8.0
    #: Seconds a collective may wait for ranks that have not arrived before the driver reports the
    #: stall (their progress and stacks); 0: never.
    stall_warning: float = 60.0
    #: The ``nics`` setting: the interfaces or subnets whose address each rank offers the others
    #: (``sparktrain.host.nics``); None: the executor's address as Spark knows it.
    nics: tuple[str, ...] | None = None
    #: The driver's channel and the native engine's ring between hosts travel in AES-256-GCM (the
    #: ``encryption`` setting, resolved on the driver; the ranks also get it as SPARKTRAIN_ENCRYPTION).
    encrypted: bool = False

    #: The ranks' Keras backend (the ``backend`` setting); ``"jax"`` hands each rank JAX's coordinator
    #: (``_jax.env.jax_env``). None: the ranks' own ``KERAS_BACKEND``, untouched.
    backend: str | None = None
    #: On a JAX run, the devices JAX's CPU platform shows in a rank without a GPU.
    jax_cpu_devices: int = 1

#: Columns of what the barrier stage returns: rank 0's pickled result, in chunks.
RESULT_FIELDS = ("rank", "seq", "data")
#: The same as a Spark schema.
RESULT_SCHEMA = "rank int, seq int, data binary"
#: The ``seq`` of the row in which a rank returns its output tail (``TaskSpec.return_output``).
OUTPUT_SEQ = -1
#: Starts rank 0's answer when its value was spilled to storage; no pickle starts this way.
SPILLED = b"SPARKTRAIN-SPILLED:"
