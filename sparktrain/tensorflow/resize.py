"""How the ranks of a ``run_elastic`` attempt learn that the driver wants a new size.

While an attempt runs, the driver (``sparktrain.driver.supervise.elastic``) may leave a marker beside the
elastic state, ``resize-<attempt>``: the cluster has had slots for more ranks for a while, or an
executor under the run is being decommissioned. The ranks then end the attempt cleanly at a
commit (``HostsUpdatedInterrupt``), and the next attempt starts at the new size from that commit.

Rank 0 watches for the marker from a thread of its own, one look a second, so that a look at
remote storage never holds up a step. The ranks agree on what it saw with one small broadcast:
at every commit (``State.check_host_updates``) and, through ``CommitStateCallback``, at every
step, so that a decommissioned executor costs nothing since the last step.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from .. import context as _ctx
from ..settings import rank as rank_settings
from ..seam import worker_env

#: Seconds between rank 0's looks for the marker.
LOOK_SECONDS = 1.0


def marker_url() -> str | None:
    """Where ``run_elastic``'s driver puts this attempt's marker, or None outside ``run_elastic``."""
    prefix, attempt = rank_settings.current().elastic_url, os.environ.get(worker_env.ELASTIC_ATTEMPT)
    if not prefix or not attempt:
        return None
    return worker_env.elastic_file(prefix, worker_env.elastic_id(os.environ), f"resize-{attempt}")


class _Watch(threading.Thread):
    """Rank 0's look for the marker, once a second, until it is found."""

    def __init__(self, url: str, storage_options: Any):
        super().__init__(name="sparktrain-elastic-resize", daemon=True)
        self.url, self.storage_options = url, storage_options
        self.found = threading.Event()
        self.why = ""

    def look(self) -> bool:
        from ..storage.backends import filesystem

        try:
            fs, path = filesystem(self.url, self.storage_options)
            fs.invalidate_cache(path.rsplit("/", 1)[0])
            if fs.exists(path):
                self.why = fs.cat_file(path).decode(errors="replace")
                self.found.set()
        except Exception:  # noqa: BLE001 - an unreachable store must not stop training; look again
            pass
        return self.found.is_set()

    def run(self) -> None:
        while not self.look():
            if self.found.wait(LOOK_SECONDS):
                return


_watch: _Watch | None = None
_lock = threading.Lock()


def _rank0_watch(storage_options: Any) -> _Watch | None:
    global _watch
    url = marker_url()
    if url is None:
        return None
    with _lock:
        if _watch is None or _watch.url != url:
            _watch = _Watch(url, storage_options)
            _watch.start()
        return _watch


def requested(storage_options: Any = None, *, look_now: bool = False) -> str:
    """Why the driver wants this attempt to end ("" when it does not), the same on every rank.

    Every rank must call it at the same points: it is one broadcast from rank 0. ``look_now``
    makes rank 0 look at the marker first (at a commit) instead of trusting its last look."""
    if marker_url() is None:
        return ""
    why = ""
    if _ctx.rank() == 0:
        watch = _rank0_watch(storage_options)
        if look_now:
            watch.look()
        why = watch.why if watch.found.is_set() else ""
    if _ctx.size() > 1:  # one int a step; the reason only when there is one
        import tensorflow as tf

        from .. import tensorflow as tfc

        if int(tfc.broadcast(tf.constant(1 if why else 0, tf.int32), 0, name="sparktrain.resize").numpy()):
            why = tfc.broadcast_object(why, 0)
    return why
