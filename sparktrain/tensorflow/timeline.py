"""A Chrome-trace timeline of this rank's collectives (Horovod's ``start_timeline``).

An event is named by the collective's ``name=`` where one was given, else by its kind
(``allreduce.sum``, ``allgather``, ...). A timeline still running when the process exits is
written then. Each rank writes its own file, so no rank waits for another to write: rank 0 writes
``file_path`` itself, rank ``r`` writes ``file_path`` with ``.rank<r>`` before its extension
(``trace.json``, ``trace.rank1.json``, ...). Every event is a complete event (``"ph": "X"``)
with the collective's name, its start (``ts``) and duration (``dur``) in microseconds since
the epoch (so the files of one host line up), ``pid`` the rank, and ``args.bytes`` the bytes the
rank sent; chrome://tracing and Perfetto (ui.perfetto.dev) open each file, and the files
concatenate. On the native engine every collective is recorded, eager or inside
``tf.function``: those run by sparktrain's TensorFlow kernels (``kernels``) are timed by the
kernel itself into a buffer that :func:`stop_timeline` drains and merges in time order, the
others (``tf.numpy_function``) in Python. On TensorFlow's runtime only eager ones are (inside a
function the ops run inside TensorFlow's executor, out of Python's sight).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

from ..errors import InvalidArgumentError


class _Timeline:
    def __init__(self):
        self.lock = threading.Lock()
        self.path: str | None = None
        self.events: list = []
        self.mark_cycles = False
        self.exit_hook = False


_timeline = _Timeline()


def rank_path(file_path: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``file_path``."""
    if rank == 0:
        return file_path
    root, ext = os.path.splitext(file_path)
    return f"{root}.rank{rank}{ext}"


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's collectives until :func:`stop_timeline`, which writes them to
    ``file_path`` (rank 0; see the module for the others). ``mark_cycles`` adds an instant
    event ("CYCLE_START") before each collective: every collective is its own cycle here."""
    from .. import context as _ctx

    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise InvalidArgumentError(f"start_timeline needs a file path, got {file_path!r}")
    path = rank_path(os.fspath(file_path), _ctx.rank())
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"start_timeline({file_path!r}): the directory {directory} does not exist; "
                                   "create it first")
    with _timeline.lock:
        if _timeline.path is None and not _timeline.exit_hook:
            atexit.register(stop_timeline)  # a script that never stops it still gets its file
            _timeline.exit_hook = True
        _timeline.path = path
        _timeline.events = [{"name": "process_name", "ph": "M", "pid": _ctx.rank(), "tid": 0,
                             "args": {"name": f"rank {_ctx.rank()}"}}]
        _timeline.mark_cycles = bool(mark_cycles)
    from . import kernels

    kernels.drain_timeline()  # nothing from before this start
    kernels.set_timeline(True)


def stop_timeline() -> str | None:
    """Write the recorded events and stop recording; returns the file written (None when no
    timeline was started)."""
    from . import kernels

    with _timeline.lock:
        path, events = _timeline.path, _timeline.events
        _timeline.path, _timeline.events = None, []
        mark_cycles = _timeline.mark_cycles
    if path is None:
        return None
    kernels.set_timeline(False)
    from_kernels = kernels.drain_timeline()
    if from_kernels:
        from .. import context as _ctx

        rank = _ctx.rank()
        if any(queued for *_, queued in from_kernels):
            events.extend(_lanes(rank))
        for name, nbytes, start_us, end_us, queued_us in from_kernels:
            if queued_us:
                events.append({"name": f"{name} ready", "ph": "i", "s": "t", "ts": queued_us, "pid": rank, "tid": 0})
            events.extend(_events(name, nbytes, start_us, end_us, rank, mark_cycles, tid=1 if queued_us else 0))
        events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))  # stable: a cycle mark stays first
    with open(path + ".tmp", "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(path + ".tmp", path)
    return path


def active() -> bool:
    return _timeline.path is not None


def now_us() -> float:
    return time.time() * 1e6


def record(name: str, nbytes: int, start_us: float, end_us: float) -> None:
    """Add one collective to the timeline (nothing when none is being recorded)."""
    if _timeline.path is None:
        return
    from .. import context as _ctx

    rank = _ctx.rank()
    with _timeline.lock:
        if _timeline.path is None:
            return
        _timeline.events.extend(_events(name, nbytes, start_us, end_us, rank, _timeline.mark_cycles))


def _lanes(rank: int) -> list:
    """The names of a rank's two lanes: the collectives run in place (eager ones, and those a
    ``tf.function`` runs on TensorFlow's thread) and those of the engine's thread (gradient buckets)."""
    return [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
            for tid, name in ((0, "TensorFlow"), (1, "engine thread: gradient buckets"))]


def _events(name: str, nbytes: int, start_us: float, end_us: float, rank: int, mark_cycles: bool,
            tid: int = 0) -> list:
    out = []
    if mark_cycles:
        out.append({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": start_us, "pid": rank, "tid": tid})
    out.append({"name": name, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us), "pid": rank, "tid": tid,
                "args": {"bytes": int(nbytes)}})
    return out
