"""The warm rank process: one per Spark Python worker, started after a run for the next one.

Spark runs one task at a time in a Python worker and reuses the worker for the next task
(spark.python.worker.reuse). So a short while after a run's task succeeds, the worker starts the
next run's rank process, held (see ``ChildProcess.go``), in a work directory of its own; the next
run whose rank lands in this worker takes it instead of starting an interpreter on its own path.
The process dies with the worker, as every rank process does (see ``child``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Callable, Mapping

from .supervisor import ChildProcess

#: The warm process is started this long after its run's task ended, from a timer thread: not at
#: once, when its interpreter's start would take the CPU from the end of the run (the task's
#: completion, the driver's collect) and slow the run down as much as it speeds the next one up.
DELAY = 0.2

_lock = threading.Lock()
_process: ChildProcess | None = None
_timer: threading.Timer | None = None


def leave(make_env: Callable[[str], Mapping[str, str]]) -> None:
    """Start the next run's rank process in ``DELAY`` seconds, with ``make_env(its work directory)``:
    the environment this run's rank process started with, which a next run with the same ``env=``
    can take."""
    global _timer

    def start() -> None:
        global _process
        with _lock:
            if _timer is not timer:  # a run took over this worker meanwhile
                return
            if _process is not None:  # left by a run before one that did not take it
                _discard(_process, 1.0)
                _process = None
            home = tempfile.mkdtemp(prefix="sparktrain-warm-")
            try:
                _process = ChildProcess(home, make_env(home), held=True)
            except OSError:
                shutil.rmtree(home, ignore_errors=True)

    with _lock:
        timer = _timer = threading.Timer(DELAY, start)
        timer.daemon = True  # never keeps the worker alive
        timer.start()


def take() -> ChildProcess | None:
    """This worker's warm rank process, if one waits; the caller owns it and its work directory
    (``workdir``), and moves it into its own (``move``, then ``go(..., workdir)``). A start still
    pending is called off: this run starts its own process."""
    global _process, _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
            _timer = None
        child, _process = _process, None
    if child is not None and (child.poll() is not None or not os.path.isdir(child.workdir)):
        _discard(child, 1.0)
        child = None
    return child


def _discard(child: ChildProcess, grace: float) -> None:
    """A warm process no run will take: it exits without running anything, and its directory goes."""
    child.release(grace)
    shutil.rmtree(child.workdir, ignore_errors=True)
