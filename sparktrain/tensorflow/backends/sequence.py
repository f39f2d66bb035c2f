"""Collectives of a TensorFlow 1 graph in the same order on every rank: the keys of both native
backends (:func:`key_for`), and the sequencer of ``numpy_function`` collectives (the kernels
have their own, in C++: ``native/tf_sequencer.cc``, which does the same without holding a
session thread per waiting op).

The native engine pairs each rank's next collective with every other rank's next one. Eagerly,
ops run in program order, and ``tf.function`` runs its stateful ops (every collective is one) in
program order too. A TensorFlow 1 graph run by a session has no such order: ops that do not
depend on each other run in any order, even at once on the session's threads, so two ranks
could pair different collectives, which is an error when their shapes differ and a wrong result
when they agree.

So each collective built into such a graph gets a key when it is built: the graph's number in
this process and the op's number in the graph. Every rank builds the same graphs in the same
order (as Horovod requires), so the keys agree. When a step runs these ops, each waits here
instead of calling the engine, and the ranks agree on which to run, as Horovod's coordinator
does: in rounds, each rank sends the keys it has waiting (two small allgathers), and the keys
waiting on every rank run, lowest first. An op can only depend on ops built before it, so a key
waiting on one rank is, or will be, waiting on every rank of the same step.

One thread at a time holds the turn: it holds a round and runs what the ranks agreed on, the
other threads' ops included; the other threads wait for the turn or for their op to be run.

A session runs each waiting op on one of its inter-op threads, and the op holds that thread until
it has run. A step with more collectives that do not depend on each other than the session has
threads can leave each rank's threads holding ops that no other rank holds: then nothing can
run. When the ranks have agreed on nothing for the collective timeout, every rank fails all its
waiting ops together, with an error naming what each rank waits for.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref

import numpy as np

from ...errors import SparkTrainError

#: The longest wait between two rounds in which the ranks agreed on nothing: by then, another
#: op of the step may have come in here on this rank.
IDLE_ROUND_SECONDS = 0.001

class Keys:
    """Numbers the collectives built into graphs, for one communicator's :class:`Sequencer`: each
    communicator (the global one, each process set's) counts only its own collectives, which are
    the ones every rank of it builds."""

    def __init__(self):
        self._graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def key_for(self, graph) -> int:
        """The next collective's key in ``graph``: the same on every rank that builds the same
        graphs in the same order."""
        with self._lock:
            numbered = self._graphs.get(graph)
            if numbered is None:
                numbered = self._graphs[graph] = (next(self._numbers), itertools.count())
            number, ops = numbered
            return (number << 32) | next(ops)


_keys = Keys()


def key_for(graph) -> int:
    """The next key of the global communicator's collectives in ``graph`` (see :class:`Keys`)."""
    return _keys.key_for(graph)


class _Waiting:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = self.error = None


class Sequencer:
    """Runs keyed collectives in the order every rank agrees on (see the module's doc)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._turn = threading.Lock()
        self._waiting: dict[int, list[_Waiting]] = {}
        self._idle_since: float | None = None  # when the rounds last ran nothing

    def run(self, comm, key: int, fn, args: tuple, timeout: float):
        """``fn(*args)`` once every rank has the op ``key`` waiting, in the agreed order."""
        me = _Waiting(fn, args)
        with self._lock:
            self._waiting.setdefault(key, []).append(me)
            self._arrived.notify_all()
        while not me.done.is_set():
            with self._turn:
                if not me.done.is_set():
                    try:
                        self._round(comm, timeout)
                    except BaseException as e:  # the engine failed: this op fails with it
                        self._forget(key, me)
                        raise e from None
        if me.error is not None:
            raise me.error
        return me.result

    def _forget(self, key: int, me: _Waiting) -> None:
        with self._lock:
            entries = self._waiting.get(key, [])
            if me in entries:
                entries.remove(me)
            if not entries:
                self._waiting.pop(key, None)

    def _round(self, comm, timeout: float) -> None:
        with self._lock:
            mine = np.array(sorted(self._waiting), np.int64)
        idle = self._idle_since is not None and time.monotonic() - self._idle_since > timeout
        counts_and_idle = comm.allgather(np.array([len(mine), idle], np.int64)).reshape(-1, 2)
        every = np.split(comm.allgather(mine), np.cumsum(counts_and_idle[:, 0])[:-1])
        common = set.intersection(*[set(keys.tolist()) for keys in every])
        if not common and counts_and_idle[:, 1].any():  # every rank decides this in the same round
            self._fail_all(_stuck(every, timeout))
            return
        if not common:
            with self._lock:
                if self._idle_since is None:
                    self._idle_since = time.monotonic()
                if len(self._waiting) == len(mine):
                    self._arrived.wait(IDLE_ROUND_SECONDS)
            return
        self._idle_since = None
        for key in sorted(common):
            with self._lock:
                entries = self._waiting[key]
                entry = entries.pop(0)
                if not entries:
                    del self._waiting[key]
            try:
                entry.result = entry.fn(*entry.args)
            except BaseException as e:  # noqa: BLE001 - raised in the thread whose op it is
                entry.error = e
            entry.done.set()

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            entries = [e for waiting in self._waiting.values() for e in waiting]
            self._waiting.clear()
            self._idle_since = None
        for entry in entries:
            entry.error = error
            entry.done.set()


class StuckError(SparkTrainError, TimeoutError):
    """The ranks wait for collectives of a TensorFlow 1 graph that none of them can run."""


def _stuck(every: list, timeout: float) -> StuckError:
    def named(keys) -> str:
        return ", ".join(f"op {k & 0xFFFFFFFF} of graph {k >> 32}" for k in keys.tolist()) or "nothing"

    waits = "; ".join(f"rank {r} waits for {named(keys)}" for r, keys in enumerate(every))
    return StuckError(
        f"the ranks waited {timeout:g} s for collectives of a TensorFlow 1 graph and could run none of them: "
        f"{waits}. Every collective a session step runs holds one of the session's inter-op threads until all "
        "ranks run it; give the session more threads than the step has collectives that do not depend on each "
        "other (tf.compat.v1.ConfigProto(inter_op_parallelism_threads=...)), or order them with "
        "tf.control_dependencies. Ranks must also build the same graphs in the same order")


#: This process's sequencer.
sequencer = Sequencer()
