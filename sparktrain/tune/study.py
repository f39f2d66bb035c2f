"""``sparktrain.tune.optimize``: an Optuna study whose trials are gangs of ranks, several at a time.

The steps, on the driver:

1. check the arguments and ``run``'s keywords (as ``run`` does, before anything launches), and
   that ``concurrent_trials`` gangs of ``num_proc`` ranks fit in the cluster's slots (``slots``);
2. open the study's trial server (``server``), where every rank of a running trial asks the study;
3. hand Optuna's own ``Study.optimize`` an objective that runs each trial as one gang
   (``gang.Gangs``), with ``n_jobs`` = the number of gangs at once: Optuna's loop asks the
   sampler, keeps the heartbeat of each running trial (RDB storages with ``heartbeat_interval``),
   fails the stale trials of a dead driver before it asks, tells the study, calls the callbacks,
   honours ``n_trials``, ``timeout``, ``catch``, ``gc_after_trial`` and ``study.stop()``;
4. on an interrupt (Ctrl-C, a notebook's stop button), cancel every running gang, then let the
   interrupt through.

Only the driver touches Optuna's study; the ranks see ``rank.RankTrial``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterable, Iterator

from ..errors import InvalidArgumentError, RankFailedError
from . import slots
from .board import Board
from .gang import Gangs
from .server import TrialServer
from .tracking import StudyRuns

log = logging.getLogger("sparktrain")

#: ``run``'s keywords a study sets itself, per trial.
_OWN = {"args": "the objective takes the trial alone; bind other arguments with functools.partial or a closure",
        "kwargs": "the objective takes the trial alone; bind other arguments with functools.partial or a closure",
        "checkpoint_url": "a trial's value is rank 0's return value; write checkpoints inside the objective",
        "stdout": "the study's output goes to its own stdout= (tune.optimize's), each trial's line marked",
        "max_attempts": "a failed trial is a trial's failure; queue it again with Optuna's retry callbacks",
        "run_id": "each trial is a run of its own; a study resumes from its Optuna storage"}


def optimize(study, objective: Callable[[Any], Any], n_trials: int | None = None, timeout: float | None = None,
             *, concurrent_trials: int | None = None, num_proc: int = 2,
             catch: Iterable[type[Exception]] | type[Exception] = (RankFailedError,),
             callbacks: Iterable[Callable] | None = None, gc_after_trial: bool = False,
             stdout=None, **run_kwargs: Any) -> None:
    """Optimize ``study`` with ``objective`` run on ``num_proc`` ranks per trial, ``concurrent_trials``
    trials at once, each trial one ``sparktrain.run`` (docs/tune.md).

    Parameters
    ----------
    study : an ``optuna.Study``; with an RDB or journal storage, a later call goes on where this one stopped.
    objective : ``objective(trial)``, called on every rank of a trial; ``trial`` behaves as Optuna's
        (suggestions are the same on every rank, rank 0's reports are recorded, ``should_prune``
        agrees across ranks); rank 0's return value is the trial's value.
    n_trials, timeout, callbacks, gc_after_trial : as in ``Study.optimize``.
    catch : the errors that fail a trial and let the study go on, as in ``Study.optimize``; by
        default a rank's error (``RankFailedError``).
    concurrent_trials : gangs at once; None: as many as the cluster's slots hold. More than the
        slots hold is refused before any trial starts.
    num_proc : ranks per trial (negative: that many processes on this machine, without Spark).
    stdout : where the study's table or lines, and the trials' output, go (default ``sys.stdout``).
    **run_kwargs : ``sparktrain.run``'s other keywords, for every trial (``resources``, ``env``,
        ``use_gpu``, ``timeout``, ``data``, ...).

    >>> def objective(trial):                                           # doctest: +SKIP
    ...     lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    ...     return train_and_score(lr)          # on every rank; rank 0's value counts
    >>> study = optuna.create_study(storage="sqlite:///study.db", study_name="digits", load_if_exists=True)
    >>> sparktrain.tune.optimize(study, objective, n_trials=16, concurrent_trials=2, num_proc=2)  # doctest: +SKIP
    """
    import optuna

    from ..driver import face

    if not isinstance(study, optuna.Study):
        raise InvalidArgumentError(f"study must be an optuna.Study (optuna.create_study(...)); got "
                                   f"{type(study).__name__}")
    if not callable(objective):
        raise InvalidArgumentError(f"objective must be a function of the trial; got {type(objective).__name__}")
    for name in run_kwargs:
        if name in _OWN:
            raise InvalidArgumentError(f"tune.optimize sets run's {name}= itself for each trial: {_OWN[name]}")
    catch = tuple(catch) if isinstance(catch, (list, tuple, set, frozenset)) else (catch,)
    # run's own checks, once, before any trial: a bad keyword, an objective that cannot be pickled.
    try:
        a = face.arguments(_objective_shape, args=(objective,), num_proc=num_proc, **run_kwargs)
    except TypeError as e:
        raise InvalidArgumentError(f"tune.optimize passes its other keywords to sparktrain.run: {e}") from None
    launch = face.prepare(a, _view(a, concurrent_trials))
    cfg = launch.cfg
    gangs = slots.concurrent_gangs(concurrent_trials, abs(a.size or num_proc), launch.slots())
    _warn_without_heartbeat(study)
    board = Board(stdout, study.study_name, ", ".join(d.name.lower() for d in study.directions))
    server = TrialServer(cfg.driver_host, cfg.encrypted)
    run_kwargs = {"verbose": 0, **run_kwargs}
    trials = Gangs(objective, num_proc, run_kwargs, server, board, StudyRuns.active(), face.run)
    log.info("sparktrain: tune: study %s, %s trial(s) of %d rank(s), %d at once", study.study_name,
             "unbounded" if n_trials is None else n_trials, abs(num_proc), gangs)
    try:
        with _cancel_on_interrupt(trials), _asks_one_at_a_time(study):
            study.optimize(trials, n_trials=n_trials, timeout=timeout, n_jobs=gangs, catch=catch,
                           callbacks=callbacks, gc_after_trial=gc_after_trial)
    finally:
        server.close()


def _objective_shape(objective):  # what run's checks pickle: the objective, as each trial ships it
    return objective


def _view(a, concurrent_trials: int | None):
    """The cluster the trials run on. Without an active session, an embedded local session wide
    enough for the gangs (``run`` alone would start one as wide as one gang)."""
    from ..driver import face

    if not a.local and face.active_session() is None:
        width = max(os.cpu_count() or 1, (concurrent_trials or 1) * (a.size or 1))
        face.start_session(f"local[{width}]")
        log.info("sparktrain: tune: no active SparkSession; started an embedded local[%d] session", width)
    return face.choose_view(a.local, a.size, a.use_gpu)


def _warn_without_heartbeat(study) -> None:
    from optuna.storages._heartbeat import is_heartbeat_enabled  # Optuna's own test, as its loop uses it

    storage = study._storage
    kind = type(getattr(storage, "_backend", storage)).__name__
    if "InMemory" in kind or is_heartbeat_enabled(storage):
        return
    log.warning("sparktrain: tune: study %s's storage (%s) keeps no heartbeat: trials running when this driver "
                "dies stay RUNNING in it. An RDBStorage with heartbeat_interval fails them on the next "
                "optimize (docs/tune.md)", study.study_name, kind)


@contextlib.contextmanager
def _asks_one_at_a_time(study) -> Iterator[None]:
    """Optuna's worker threads ask for trials one at a time: while the loop runs, this study's
    ``study.ask()`` (which Optuna's loop calls) takes a lock. An RDB storage claims a queued trial
    (``enqueue_trial``) with ``SELECT ... FOR UPDATE``, which SQLite lacks, so two asks at once on an
    SQLite storage can both find the same trial waiting and both take it."""
    ask, lock = study.ask, threading.Lock()

    def one_at_a_time(*args, **kwargs):
        with lock:
            return ask(*args, **kwargs)

    study.ask = one_at_a_time
    try:
        yield
    finally:
        del study.ask  # the class's method again


@contextlib.contextmanager
def _cancel_on_interrupt(trials: Gangs) -> Iterator[None]:
    """Ctrl-C in the main thread cancels every running gang, then raises as usual: Optuna's loop
    waits for its worker threads before it lets the interrupt through, and their gangs must end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous is signal.SIG_IGN:
        yield
        return

    def on_sigint(signum, frame):
        trials.cancel("the study was interrupted")
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
