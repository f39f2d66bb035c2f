"""How many gangs a study runs at once, and what a gang's end makes of its trial. Pure.

The driver never submits a gang the cluster cannot hold: a barrier stage that cannot get every
slot it needs waits, or fails. So ``concurrent_trials`` gangs of ``num_proc`` ranks must fit in the
slots the cluster has, checked before any trial starts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InvalidArgumentError


def concurrent_gangs(concurrent_trials: int | None, num_proc: int, slots: int) -> int:
    """The number of gangs to run at once: ``concurrent_trials``, checked against ``slots``, or as
    many as the slots hold (None). ``slots`` 0: the cluster's slots cannot be counted (Spark
    Connect without a conf that says), and ``concurrent_trials`` is taken as given (None: 1).

    >>> concurrent_gangs(None, 2, 5)
    2
    >>> concurrent_gangs(3, 2, 4)
    Traceback (most recent call last):
    ...
    sparktrain.errors.InvalidArgumentError: concurrent_trials=3 gangs of num_proc=2 ranks need 6 task slots at once; the cluster has 4. Lower concurrent_trials to 2 or fewer (None takes as many as fit), lower num_proc, or add executors
    """
    if concurrent_trials is not None and (type(concurrent_trials) is not int or concurrent_trials < 1):
        raise InvalidArgumentError(f"concurrent_trials must be a positive int, or None for as many gangs as the "
                                   f"cluster's slots hold; got {concurrent_trials!r}")
    if slots <= 0:
        return concurrent_trials or 1
    fit = slots // num_proc
    if fit < 1:
        raise InvalidArgumentError(f"a trial's gang of num_proc={num_proc} ranks needs {num_proc} task slots at "
                                   f"once; the cluster has {slots}. Lower num_proc or add executors")
    if concurrent_trials is None:
        return fit
    if concurrent_trials * num_proc > slots:
        raise InvalidArgumentError(
            f"concurrent_trials={concurrent_trials} gangs of num_proc={num_proc} ranks need "
            f"{concurrent_trials * num_proc} task slots at once; the cluster has {slots}. Lower concurrent_trials "
            f"to {fit} or fewer (None takes as many as fit), lower num_proc, or add executors")
    return concurrent_trials


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a gang's end makes of its trial: Optuna's state ("COMPLETE", "PRUNED", "FAIL"), the
    value for a complete one, the message for a pruned or failed one."""

    state: str
    value: Any = None
    message: str = ""


def outcome(returned: Any = None, error: BaseException | None = None) -> Outcome:
    """The outcome of a gang that returned ``returned`` (rank 0's ``rank.Finished`` or ``rank.Pruned``)
    or raised ``error``."""
    from .rank import Finished, Pruned

    if error is not None:
        return Outcome("FAIL", message=first_line(str(error)) or type(error).__name__)
    if isinstance(returned, Pruned):
        return Outcome("PRUNED", message=returned.message)
    if isinstance(returned, Finished):
        return Outcome("COMPLETE", value=returned.value)
    return Outcome("FAIL", message=f"rank 0 returned {type(returned).__name__}, not the objective's value "
                                   "(the trial ran something other than its objective)")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
