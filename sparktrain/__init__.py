"""sparktrain: data-parallel TensorFlow/Keras training on a Spark cluster.

The driver calls :func:`run`; inside ``train_fn`` each rank asks :func:`rank`, :func:`size`
and friends who it is. Importing this package is cheap: pyspark, cloudpickle and TensorFlow
are imported only inside the functions that need them.
"""
from __future__ import annotations

from .context import attempt, cross_rank, cross_size, is_chief, local_rank, local_size, rank, size
from .errors import (BackendMissingError, ClusterConfigError, CorruptCheckpointError, CredentialsError,
                     ForbiddenError, InsufficientResourcesError, InvalidArgumentError, NotFoundError,
                     PicklingFailedError, RankFailedError, RankFailure, ResultTooLargeError, RunCancelledError,
                     RunTimeoutError, SparkTrainError, StartTimeoutError, StorageError, UnknownSchemeError,
                     UnsupportedError, VersionMismatchError)

__version__ = "0.1.0"

__all__ = [
    "run", "run_elastic", "HorovodRunner", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_chief", "attempt",
    "SparkTrainError", "InvalidArgumentError", "PicklingFailedError", "ClusterConfigError",
    "InsufficientResourcesError", "StartTimeoutError", "RunTimeoutError", "RunCancelledError",
    "ResultTooLargeError", "RankFailedError", "RankFailure", "VersionMismatchError",
    "StorageError", "BackendMissingError", "UnknownSchemeError", "NotFoundError", "CredentialsError",
    "ForbiddenError", "CorruptCheckpointError", "UnsupportedError",
]


def __getattr__(name: str):
    # ``run`` lives with the driver-side machinery; rank processes import this package for
    # the worker API alone and should not pay for the driver's imports at start-up.
    if name == "run":
        from .driver.run import run

        globals()["run"] = run
        return run
    if name == "run_elastic":
        from .driver.run import run_elastic

        globals()["run_elastic"] = run_elastic
        return run_elastic
    if name == "HorovodRunner":
        from .horovod_runner import HorovodRunner

        globals()["HorovodRunner"] = HorovodRunner
        return HorovodRunner
    raise AttributeError(f"module 'sparktrain' has no attribute {name!r}")
