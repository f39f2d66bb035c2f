"""Worker-side API: who am I in this run? Reads only the env contract (see worker_env).

Outside a run (no ``SPARKTRAIN_*`` variables at all) every function answers as the single
process of a one-process run, rank 0 of size 1, after one warning, so that a training script
also runs standalone. A half-set environment is an error: it means something overwrote
part of the contract, and guessing would silently train on the wrong shard.
"""
from __future__ import annotations

import os
import threading
import warnings

from .seam import worker_env as _we
from .errors import SparkTrainError

_warned = False
_warn_lock = threading.Lock()

_STANDALONE = {
    _we.RANK: 0, _we.SIZE: 1, _we.LOCAL_RANK: 0, _we.LOCAL_SIZE: 1, _we.CROSS_RANK: 0, _we.CROSS_SIZE: 1,
}


def _read(name: str) -> int:
    present = [v for v in _we.TOPOLOGY_VARS if v in os.environ]
    if not present:
        global _warned
        with _warn_lock:
            if not _warned:
                _warned = True
                warnings.warn(
                    "sparktrain: not running inside sparktrain.run(); answering as rank 0 of size 1",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _STANDALONE[name]
    missing = [v for v in _we.TOPOLOGY_VARS if v not in os.environ]
    if missing:
        raise SparkTrainError(
            f"the sparktrain environment is half-set: {', '.join(present)} present but "
            f"{', '.join(missing)} missing. Something changed os.environ inside the run; "
            f"set all of {', '.join(_we.TOPOLOGY_VARS)} or none of them"
        )
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise SparkTrainError(f"{name}={raw!r} is not an integer; the sparktrain environment is corrupted") from None


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return _read(_we.RANK)


def size() -> int:
    """The number of processes in the run."""
    return _read(_we.SIZE)


def local_rank() -> int:
    """This process's index among the run's processes on the same host."""
    return _read(_we.LOCAL_RANK)


def local_size() -> int:
    """The number of the run's processes on this host."""
    return _read(_we.LOCAL_SIZE)


def cross_rank() -> int:
    """This host's index among the hosts that run a process with this local rank."""
    return _read(_we.CROSS_RANK)


def cross_size() -> int:
    """The number of hosts that run a process with this local rank."""
    return _read(_we.CROSS_SIZE)


def is_chief() -> bool:
    """True on rank 0, the rank whose return value ``run`` returns."""
    return rank() == 0


def attempt() -> int:
    """Which attempt of the run this is: 1, then 2, ... when ``run(..., max_attempts=N)`` re-runs it.

    A retried ``train_fn`` can use it to log, or to resume from its latest checkpoint. Outside a
    run it is 1.
    """
    raw = os.environ.get(_we.ATTEMPT)
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise SparkTrainError(f"{_we.ATTEMPT}={raw!r} is not an integer; the sparktrain environment is corrupted") \
            from None
