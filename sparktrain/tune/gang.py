"""One trial as one gang: what Optuna's loop calls, in its worker thread, for each trial it asks for.

:class:`Gangs` turns the user's objective into the objective Optuna's ``Study.optimize`` runs: for
each trial, one ``sparktrain.run`` (its own barrier stage, run id, secret and channel) of
``rank.objective_on_rank`` on ``num_proc`` ranks, answered by the study's ``TrialServer`` while it
runs. Rank 0's value is the trial's value; a pruned gang raises ``optuna.TrialPruned``; a failed
one keeps the rank's error as the trial's ``sparktrain_error`` user attribute and raises it.
Every run is supervised inside the study's :class:`~sparktrain.driver.supervise.interrupts.Cancellation`,
so an interrupt stops every running gang.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

from ..driver.face import Cancellation
from ..errors import RunCancelledError, SparkTrainError
from . import ERROR_ATTR, slots
from .board import Board
from .rank import TrialAddress, objective_on_rank
from .server import TrialServer
from .tracking import StudyRuns

log = logging.getLogger("sparktrain")

#: How much of a rank's error the attribute keeps.
ERROR_CHARS = 2000


class Gangs:
    """The trials' gangs of one ``optimize`` call (see the module's doc)."""

    def __init__(self, objective: Callable[[Any], Any], num_proc: int, run_kwargs: Mapping[str, Any],
                 server: TrialServer, board: Board, runs: StudyRuns | None, run: Callable[..., Any]):
        self.objective, self.num_proc, self.run_kwargs = objective, num_proc, dict(run_kwargs)
        self.server, self.board, self.runs, self._run = server, board, runs, run
        self.cancellation = Cancellation()
        self._lock = threading.Lock()
        self.running: set[int] = set()

    def __call__(self, trial) -> Any:
        """Optuna's objective: run ``trial`` as one gang and return its value."""
        import optuna

        if self.cancellation.reason is not None:
            raise RunCancelledError(f"trial {trial.number} did not start: {self.cancellation.reason}")
        with self._lock:
            self.running.add(trial.number)
        self.board.started(trial.number, self.num_proc, trial.params)
        env = dict(self.run_kwargs.get("env") or {})
        if self.runs is not None:
            env.update(self.runs.start(trial.number))
        address = TrialAddress(*self.server.address, self.server.secret, self.server.encrypted, trial.number)
        returned, error = None, None
        try:
            with self.server.serve(trial, self._reported, self.board.params), self.cancellation.scope():
                returned = self._run(objective_on_rank, args=(self.objective, address), num_proc=self.num_proc,
                                     stdout=self.board.stream(trial.number),
                                     **{**self.run_kwargs, "env": env})
        except (SparkTrainError, KeyboardInterrupt) as e:
            error = e
        finally:
            with self._lock:
                self.running.discard(trial.number)
        ended = slots.outcome(returned, error)
        if ended.state == "FAIL" and error is not None:
            try:
                trial.set_user_attr(ERROR_ATTR, str(error)[:ERROR_CHARS])
            except Exception as e:  # noqa: BLE001 - the storage may be what failed; the error still stands
                log.warning("sparktrain: tune: could not keep trial %d's error in the study: %s", trial.number, e)
        self._ended(trial, ended)
        if error is not None:
            raise error
        if ended.state == "PRUNED":
            raise optuna.TrialPruned(ended.message)
        if ended.state == "FAIL":
            raise SparkTrainError(f"trial {trial.number}: {ended.message}")
        return ended.value

    def cancel(self, reason: str) -> None:
        """Stop every running gang (each run raises ``RunCancelledError``), and start no more."""
        self.cancellation.cancel(reason)

    def _reported(self, number: int, step: int, value: float) -> None:
        self.board.reported(number, step, value)
        if self.runs is not None:
            try:
                self.runs.report(number, step, value)
            except Exception as e:  # noqa: BLE001 - tracking must not stop a trial
                log.warning("sparktrain: tune: MLflow did not take trial %d's report: %s", number, e)

    def _ended(self, trial, ended: slots.Outcome) -> None:
        params = trial.params
        best = _best(trial.study, ended, trial.number)
        self.board.ended(trial.number, ended.state, params, ended.value, ended.message, best)
        if self.runs is not None:
            try:
                self.runs.end(trial.number, ended.state, params, ended.value)
            except Exception as e:  # noqa: BLE001
                log.warning("sparktrain: tune: MLflow did not take trial %d's end: %s", trial.number, e)


def _best(study, ended: slots.Outcome, number: int) -> tuple[int, Any] | None:
    """The best complete trial so far, counting this one (not yet told to the study)."""
    if len(study.directions) > 1:
        return None
    best = None
    try:
        done = study.best_trial
        best = (done.number, done.value)
    except ValueError:  # no complete trial yet
        pass
    if ended.state == "COMPLETE" and isinstance(ended.value, (int, float)):
        import optuna

        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        if best is None or (ended.value > best[1] if maximize else ended.value < best[1]):
            best = (number, float(ended.value))
    return best
