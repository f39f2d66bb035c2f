"""Ctrl-C while an attempt is supervised: counted by the signal handler, raised where it is safe.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is at. When that is just
after a lock was taken inside an ``__enter__`` written in Python (``threading.Condition``'s, under
``queue.Queue.get`` and ``threading.Event.wait``), the ``with`` block is never entered and the lock
is never released: the supervision loop's next wait on it, and every thread that reports to it,
then block for good. The driver hangs instead of printing the ranks' stacks and stopping them.

So, while an attempt is supervised from the main thread, SIGINT only counts and wakes the loop;
the loop raises ``KeyboardInterrupt`` at the top of its next turn (:meth:`Interrupts.check`), and a
second interrupt cuts the stack report short. The handler that was there before comes back when
supervision ends. A SIGINT that the process ignores stays ignored, and a run supervised from
another thread keeps Python's own handling (only the main thread can set a handler).

A run supervised from another thread (a trial of ``sparktrain.tune``) is stopped from outside
through a :class:`Cancellation` that its thread entered (:meth:`Cancellation.scope`): its
:meth:`~Cancellation.cancel` wakes every attempt supervised in that scope, which raises
``RunCancelledError`` at the top of its next turn and stops its ranks as for Ctrl-C.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

from ...errors import RunCancelledError

_scope = threading.local()


class Cancellation:
    """A stop order for the runs supervised in threads that entered :meth:`scope`: :meth:`cancel`
    (from any thread, or a signal handler) makes each raise ``RunCancelledError`` with ``reason``."""

    def __init__(self):
        self.reason: str | None = None
        self._wakes: set[Callable[[], None]] = set()
        # Reentrant: cancel() may run in a signal handler while this thread is in _watch.
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Cancellation]:
        """The runs this thread supervises inside the block obey this cancellation."""
        previous = getattr(_scope, "current", None)
        _scope.current = self
        try:
            yield self
        finally:
            _scope.current = previous

    def cancel(self, reason: str) -> None:
        self.reason = reason
        with self._lock:
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def _watch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.add(wake)
        if self.reason is not None:
            wake()

    def _unwatch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.discard(wake)


class Interrupts:
    """``with Interrupts(wake) as interrupts:`` counts SIGINT and calls ``wake`` (which must be safe
    in a signal handler: ``queue.SimpleQueue.put`` is) until the block ends."""

    def __init__(self, wake: Callable[[], None] = lambda: None):
        self._wake = wake
        self._previous = None
        #: SIGINTs received since the block began.
        self.count = 0
        #: The cancellation this thread entered, if any, watched while the block runs.
        self._cancellation: Cancellation | None = None

    def __enter__(self) -> Interrupts:
        self._cancellation = getattr(_scope, "current", None)
        if self._cancellation is not None:
            self._cancellation._watch(self._wake)
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            # None: a handler not set from Python, which could not be put back; SIG_IGN: ignored on purpose.
            if previous is not None and previous is not signal.SIG_IGN:
                self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._cancellation is not None:
            self._cancellation._unwatch(self._wake)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1
        self._wake()

    def check(self, allowed: int = 0) -> None:
        """Raise ``KeyboardInterrupt`` if more than ``allowed`` interrupts came, or
        ``RunCancelledError`` if the thread's cancellation was cancelled."""
        if self._cancellation is not None and self._cancellation.reason is not None:
            raise RunCancelledError(self._cancellation.reason)
        if self.count > allowed:
            raise KeyboardInterrupt
