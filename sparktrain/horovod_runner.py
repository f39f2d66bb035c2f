"""``sparktrain.HorovodRunner``: the runner of Databricks' ``sparkdl`` package, over :func:`sparktrain.run`.

A notebook written for ``from sparkdl import HorovodRunner`` runs with that import changed to
``from sparktrain import HorovodRunner``; its ``np`` and ``driver_log_verbosity`` keep their meaning
as far as sparktrain can give it (docs/from-horovod.md, "HorovodRunner").

Pure on import: :func:`sparktrain.run` (and pyspark with it) is imported when :meth:`HorovodRunner.run`
is called, so ``import sparktrain`` stays cheap.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import InvalidArgumentError

#: sparkdl's two values of ``driver_log_verbosity``, and its default.
VERBOSITIES = ("all", "log_callback_only")
DEFAULT_VERBOSITY = "log_callback_only"


def check_np(np: Any) -> int:
    """``np`` as sparkdl takes it: a nonzero int; the message names the value and what to pass."""
    if isinstance(np, bool) or not isinstance(np, int):
        raise InvalidArgumentError(
            f"HorovodRunner's np must be an int, got {np!r} ({type(np).__name__}): np=N runs N ranks on the "
            "Spark cluster, np=-N runs N processes on the driver")
    if np == 0:
        raise InvalidArgumentError(
            "HorovodRunner's np must not be 0, got 0: pass np=N (N > 0) for N ranks on the Spark cluster, or "
            "np=-N for N processes on the driver; to use every task slot, call "
            "sparktrain.run(main, kwargs=kwargs) with num_proc left out")
    return np


def check_verbosity(verbosity: Any) -> str:
    if not isinstance(verbosity, str) or verbosity not in VERBOSITIES:
        raise InvalidArgumentError(
            f"HorovodRunner's driver_log_verbosity must be 'all' (every rank's output in the cell) or "
            f"'log_callback_only' (rank 0's), got {verbosity!r}")
    return verbosity


def output_ranks_for(np: int, verbosity: str) -> str | list[int]:
    """Whose output :func:`sparktrain.run` shows for sparkdl's ``driver_log_verbosity``.

    ``"all"`` is every rank's. ``"log_callback_only"`` is rank 0's on the cluster, where sparkdl
    streams what the first worker sends (its ``LogCallback`` or ``log_to_driver``); sparktrain has no such
    channel of its own, so all of rank 0's output stands in for it. Local mode (``np < 0``) shows every
    rank's output under either value, as sparkdl's does.
    """
    return "all" if verbosity == "all" or np < 0 else [0]


class HorovodRunner:
    """Run a training function on ``np`` ranks, as ``sparkdl.HorovodRunner`` does, through :func:`sparktrain.run`.

    Parameters
    ----------
    np : how many ranks. ``np > 0``: that many tasks of one barrier-mode Spark stage on the active
        SparkSession (an embedded ``local[np]`` session where there is none), one task slot each (one
        GPU each where Spark schedules GPUs); too few slots is an ``InsufficientResourcesError`` before
        anything starts. ``np < 0``: ``-np`` processes on the driver, without Spark (local mode).
        ``0`` and anything that is not an int are refused here, with the value.
    driver_log_verbosity : ``"log_callback_only"`` (the default, as sparkdl's) shows rank 0's output in
        the cell; ``"all"`` shows every rank's, each line prefixed ``[rank]<stdout>:``. In local mode every
        rank's output shows either way. A failed rank's traceback and last lines come with the error
        whichever is chosen.

    Both are keyword-only, as sparkdl's are. The instance keeps ``np`` as ``num_processor``, as sparkdl's does.

    >>> from sparktrain import HorovodRunner
    >>> hr = HorovodRunner(np=2, driver_log_verbosity="all")  # doctest: +SKIP
    >>> hr.run(train, learning_rate=0.1)  # doctest: +SKIP
    """

    def __init__(self, *, np: int, driver_log_verbosity: str = DEFAULT_VERBOSITY) -> None:
        self.num_processor = check_np(np)
        self.driver_log_verbosity = check_verbosity(driver_log_verbosity)

    def __repr__(self) -> str:
        return f"HorovodRunner(np={self.num_processor}, driver_log_verbosity={self.driver_log_verbosity!r})"

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Call ``main(**kwargs)`` on every rank and return rank 0's value.

        ``main`` and ``kwargs`` are pickled with cloudpickle on the driver, as sparkdl does: import what
        ``main`` uses inside it. A rank that fails stops the others, and this raises sparktrain's
        ``RankFailedError`` (keyed by rank, root cause first); arguments that cannot be pickled raise
        ``PicklingFailedError`` before anything starts.

        For sparktrain's other options (``env=``, ``timeout=``, ``data=``, ...)
        call :func:`sparktrain.run` itself: ``HorovodRunner(np=n).run(main, **kw)`` is
        ``sparktrain.run(main, kwargs=kw, num_proc=n, output_ranks=...)``.
        """
        if not callable(main):
            raise InvalidArgumentError(
                f"HorovodRunner.run needs the training function first, a callable, got {main!r} "
                f"({type(main).__name__}): hr.run(main, **kwargs)")
        from .driver.face import run

        return run(main, kwargs=kwargs, num_proc=self.num_processor,
                   output_ranks=output_ranks_for(self.num_processor, self.driver_log_verbosity))
