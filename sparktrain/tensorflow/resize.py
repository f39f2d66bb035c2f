"""How the ranks of a ``run_elastic`` attempt learn that the driver wants a new size.

While an attempt runs, the driver (``sparktrain.driver.supervise.elastic``) may leave the attempt's
resize marker in the run's home (``Home.mark_resize``): the cluster has had slots for more ranks for
a while, or an executor under the run is being decommissioned. The ranks then end the attempt cleanly at a
commit (``HostsUpdatedInterrupt``), and the next attempt starts at the new size from that commit.

Rank 0 watches for the marker from a thread of its own, one look a second, so that a look at
remote storage never holds up a step. The ranks agree on what it saw with one small broadcast:
at every commit (``State.check_host_updates``) and, through ``CommitStateCallback``, at every
step, so that a decommissioned executor costs nothing since the last step.
"""
from __future__ import annotations

import threading

from .. import context as _ctx
from ..storage import rank as rank_storage
from ..storage.home import Home

#: Seconds between rank 0's looks for the marker.
LOOK_SECONDS = 1.0


def _marked() -> tuple[Home, str] | None:
    """This attempt's home and number, where ``run_elastic``'s driver may mark it; None outside ``run_elastic``."""
    home, attempt = rank_storage.home(), rank_storage.attempt()
    if home is None or attempt is None:
        return None
    return home, attempt


class _Watch(threading.Thread):
    """Rank 0's look for the marker, once a second, until it is found."""

    def __init__(self, home: Home, attempt: str):
        super().__init__(name="sparktrain-elastic-resize", daemon=True)
        self.home, self.attempt = home, attempt
        self.url = home.resize_marker(attempt)
        self.found = threading.Event()
        self.why = ""

    def look(self) -> bool:
        try:
            why = self.home.resize_asked(self.attempt)
        except Exception:  # noqa: BLE001 - an unreachable store must not stop training; look again
            why = None
        if why is not None:
            self.why = why
            self.found.set()
        return self.found.is_set()

    def run(self) -> None:
        while not self.look():
            if self.found.wait(LOOK_SECONDS):
                return


_watch: _Watch | None = None
_lock = threading.Lock()


def _rank0_watch(home: Home, attempt: str) -> _Watch:
    global _watch
    with _lock:
        if _watch is None or _watch.url != home.resize_marker(attempt):
            _watch = _Watch(home, attempt)
            _watch.start()
        return _watch


def requested(*, look_now: bool = False) -> str:
    """Why the driver wants this attempt to end ("" when it does not), the same on every rank.

    Every rank must call it at the same points: it is one broadcast from rank 0. ``look_now``
    makes rank 0 look at the marker first (at a commit) instead of trusting its last look."""
    marked = _marked()
    if marked is None:
        return ""
    why = ""
    if _ctx.rank() == 0:
        watch = _rank0_watch(*marked)
        if look_now:
            watch.look()
        why = watch.why if watch.found.is_set() else ""
    if _ctx.size() > 1:  # one int a step; the reason only when there is one
        import tensorflow as tf

        from .. import tensorflow as tfc

        if int(tfc.broadcast(tf.constant(1 if why else 0, tf.int32), 0, name="sparktrain.resize").numpy()):
            why = tfc.broadcast_object(why, 0)
    return why
