"""A named run (``run(..., run_id="name")``, ``run_elastic(..., run_id=...)``) on the driver: the
run's home (``sparktrain.storage.home``) before anything launches, and after.

Before launch: a ``run_id`` needs the ``elastic_url`` setting; a run that finished returns its
recorded result and launches nothing; otherwise this driver takes the run's lease (refused while
another driver's is live), keeps it renewed, and clears an earlier job's resize markers. The ranks
find the name as ``SPARKTRAIN_ELASTIC_ID``, so ``hvd.elastic`` commits under the home and
``@hvd.elastic.run`` resumes from the last commit of any earlier job. After: rank 0's value is
recorded in the home (whole or not at all), or the failure's first line is; the lease is released.
A driver that finds its lease lost while the run lives (another driver took it over) stops the run:
it raises ``RunCancelledError`` naming the lease.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ...errors import InvalidArgumentError
from ...seam import worker_env
from ..launch.config import RunConfig
from .interrupts import Cancellation

log = logging.getLogger("sparktrain")


def home_id(cfg: RunConfig) -> str:
    """The id the ranks commit under: the run's name where it has one, else its drawn id."""
    return cfg.args.name or cfg.args.run_id


def env(cfg: RunConfig) -> dict[str, str]:
    """What a named run's ranks find in their environment: its name, for ``hvd.elastic``."""
    return {worker_env.ELASTIC_ID: cfg.args.name} if cfg.args.name else {}


def run_named(cfg: RunConfig, launch: Callable[[], Any]) -> Any:
    """``launch()``'s value; for a named run, through its home as the module's doc says."""
    name = cfg.args.name
    if not name:
        return launch()
    url = cfg.settings.elastic_url
    if not url:
        raise InvalidArgumentError(
            f"run_id={name!r} names a run whose commits, result and lease live under the elastic_url setting, and "
            "none is set: set it to an fsspec URL every job can reach, e.g. env={'SPARKTRAIN_ELASTIC_URL': "
            "'abfss://container@account.dfs.core.windows.net/runs'} (or the driver's SPARKTRAIN_ELASTIC_URL, or "
            "spark.sparktrain.elasticUrl)")
    from ...storage import home as homes

    home = homes.Home(url, name, cfg.args.storage_options)
    what = f"run {name!r} ({home.url})"
    finished, value = home.result()
    if finished:
        log.warning("sparktrain: %s finished before; returning its recorded result, launching no rank", what)
        return value
    lease = home.lease(cfg.settings.lease_timeout)
    lease.acquire(what)
    stop = Cancellation()  # a lost lease stops the run: another driver may hold the run now
    try:
        lease.keep(what, stop.cancel)
        home.clear_markers()
        commit = home.last_commit()
        if commit is not None:
            log.warning("sparktrain: %s resumes from its last commit (epoch %s, batch %s)", what, commit["epoch"],
                        commit["batch"])
        try:
            with stop.scope():
                value = launch()
        except BaseException as e:
            _record_failure(home, what, e)
            raise
        try:
            home.record_result(value)
            log.info("sparktrain: %s finished; its result is recorded in %s", what, home.url)
        except Exception as e:  # noqa: BLE001 - the run succeeded: its value is not lost with the record
            log.error("sparktrain: %s finished, but its result could not be recorded (%s: %s); a later job with "
                      "this run_id will run it again from its last commit", what, type(e).__name__, str(e)[:200])
        return value
    finally:
        try:
            lease.release()
        except Exception as e:  # noqa: BLE001 - the run's own value or error matters more; the lease expires
            log.warning("sparktrain: %s: releasing its lease failed (%s); it expires in %.0f s", what,
                        type(e).__name__, lease.seconds)


def _record_failure(home, what: str, error: BaseException) -> None:
    """Note the failure in the home; a store that fails now must not hide the run's own error."""
    try:
        home.record_failure(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    except Exception as e:  # noqa: BLE001
        log.warning("sparktrain: %s failed, and its failure could not be recorded (%s)", what, type(e).__name__)
