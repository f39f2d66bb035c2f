"""A named run (``run(..., run_id="name")``, ``run_elastic(..., run_id=...)``) on the driver: its
home (``sparktrain.storage.home``) before the attempts, and after.

Before: a run that finished returns its recorded result and launches nothing; otherwise this
driver takes the run's lease (refused while another driver's is live), keeps it renewed, and
clears an earlier job's resize markers. The ranks find the name as ``SPARKTRAIN_ELASTIC_ID``, so
``hvd.elastic`` commits under the home and ``@hvd.elastic.run`` resumes from the last commit of
any earlier job. After: rank 0's value is recorded in the home (whole or not at all), or the
failure's first line is; the lease is released. A driver that finds its lease lost while the run
lives (another driver took it over) stops the run: it raises ``RunCancelledError`` naming the lease.
A run without a name passes through :class:`Named` untouched.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Iterator

from .interrupts import Cancellation

if TYPE_CHECKING:
    from ..launch.prepare import Launch

log = logging.getLogger("sparktrain")


class Named:
    """The bracket around a run's attempts; for a run without a name, every step does nothing."""

    def __init__(self, launch: "Launch"):
        self.home = launch.home if launch.name else None
        self.what = f"run {launch.name!r} ({self.home.url})" if self.home is not None else ""
        self.lease_timeout = launch.cfg.settings.lease_timeout
        self.lease = None
        self.stop = Cancellation()  # a lost lease stops the run: another driver may hold the run now

    def begin(self) -> tuple[bool, Any]:
        """``(True, value)`` where the run finished before; otherwise, under the run's lease, ``(False, None)``."""
        home, what = self.home, self.what
        if home is None:
            return False, None
        finished, value = home.result()
        if finished:
            log.warning("sparktrain: %s finished before; returning its recorded result, launching no rank", what)
            return True, value
        self.lease = home.lease(self.lease_timeout)
        self.lease.acquire(what)
        try:
            self.lease.keep(what, self.stop.cancel)
            home.clear_markers()
            commit = home.last_commit()
        except BaseException:
            self.end()
            raise
        if commit is not None:
            log.warning("sparktrain: %s resumes from its last commit (epoch %s, batch %s)", what, commit["epoch"],
                        commit["batch"])
        return False, None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the attempts run: a lost lease cancels them."""
        if self.home is None:
            yield
            return
        with self.stop.scope():
            yield

    def finished(self, value: Any) -> None:
        """Record rank 0's value; a store that fails now loses the record, not the value."""
        if self.home is None:
            return
        try:
            self.home.record_result(value)
            log.info("sparktrain: %s finished; its result is recorded in %s", self.what, self.home.url)
        except Exception as e:  # noqa: BLE001 - the run succeeded: its value is not lost with the record
            log.error("sparktrain: %s finished, but its result could not be recorded (%s: %s); a later job with "
                      "this run_id will run it again from its last commit", self.what, type(e).__name__, str(e)[:200])

    def failed(self, error: BaseException) -> None:
        """Note the failure in the home; a store that fails now must not hide the run's own error."""
        if self.home is None:
            return
        try:
            self.home.record_failure(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        except Exception as e:  # noqa: BLE001
            log.warning("sparktrain: %s failed, and its failure could not be recorded (%s)", self.what,
                        type(e).__name__)

    def end(self) -> None:
        """Release the lease, where this driver holds one."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            lease.release()
        except Exception as e:  # noqa: BLE001 - the run's own value or error matters more; the lease expires
            log.warning("sparktrain: %s: releasing its lease failed (%s); it expires in %.0f s", self.what,
                        type(e).__name__, lease.seconds)
