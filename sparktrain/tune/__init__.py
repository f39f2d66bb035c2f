"""``sparktrain.tune``: an Optuna study whose trials are gangs of ranks, several at a time.

>>> import optuna, sparktrain.tune                                    # doctest: +SKIP
>>> study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner())
>>> sparktrain.tune.optimize(study, objective, n_trials=16, concurrent_trials=2, num_proc=2)  # doctest: +SKIP

``objective(trial)`` runs on every rank of a trial; ``trial`` behaves as Optuna's ``Trial``
(``rank.RankTrial``). See docs/tune.md. Needs Optuna on the driver and the executors:
``pip install 'sparktrain[tune]'``.
"""
from __future__ import annotations

try:
    import optuna  # noqa: F401 - the study's library, on the driver and on every rank
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("sparktrain.tune needs Optuna on the driver and the executors: "
                      "pip install 'sparktrain[tune]'") from e

from typing import Any

#: The user attribute that keeps a failed trial's error (its first lines).
ERROR_ATTR = "sparktrain_error"

__all__ = ["optimize", "RankTrial", "ERROR_ATTR"]


def __getattr__(name: str) -> Any:
    # Lazily: a trial's rank imports this package for its RankTrial, and nothing of the driver side.
    if name == "optimize":
        from .study import optimize

        return optimize
    if name == "RankTrial":
        from .rank import RankTrial

        return RankTrial
    raise AttributeError(f"module 'sparktrain.tune' has no attribute {name!r}")
