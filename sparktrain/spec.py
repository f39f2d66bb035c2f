"""What the driver ships to every rank. Pure: shared by the driver and executor sides."""
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
    user_env: dict[str, str]
    #: cloudpickled ``(checkpoint_url, storage_options)`` when rank 0's value goes to storage.
    checkpoint: bytes | None = None
    #: Where rank 0 spills a value too large for Spark's result path (``spill_url`` setting).
    spill_url: str | None = None
    #: Which attempt of the run this is, 1-based.
    attempt: int = 1
    #: The driver's versions (see ``sparktrain.versions``); each rank checks its own against them.
    versions: dict | None = None
