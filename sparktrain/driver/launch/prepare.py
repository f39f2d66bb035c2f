"""The launch stage's one value: :func:`prepare` checks nothing more than it is given, asks the
cluster what it must (the view's probes), resolves the run's settings, and returns a
:class:`Launch`: everything the run's supervision (``sparktrain.driver.supervise``) and the
driver's clients (``sparktrain.tune``, ``sparktrain.ml``, the CLI) need of the cluster and the run,
each behind a method. Nothing in it calls back up: the supervision asks the launch, never the other
way round.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

from ...errors import InvalidArgumentError
from ...seam import worker_env
from ...seam.spec import TaskSpec
from . import config, views
from .jobs import Job
from .taskspec import task_spec

log = logging.getLogger("sparktrain")


class Launch:
    """A run, ready to launch on its view (see the module's doc). ``home`` is the run's home under
    the ``elastic_url`` setting (None where none is set): a named run's lease and result, and every
    run's commits and resize markers."""

    def __init__(self, view: views.ClusterView, cfg: config.RunConfig, profile: Any, home: Any):
        self.view, self.cfg, self.profile, self.home = view, cfg, profile, home
        self._frames: Mapping[str, Any] = dict(cfg.args.frames or {})
        self._inputs: dict[int, Any] = {}

    @property
    def run_id(self) -> str:
        return self.cfg.args.run_id

    @property
    def name(self) -> str | None:
        """The run's name (``run_id=``), or None for a run of its own."""
        return self.cfg.args.name

    @property
    def home_id(self) -> str:
        """The id the ranks commit under: the run's name where it has one, else its drawn id."""
        return self.cfg.args.name or self.cfg.args.run_id

    # -- the cluster's slots ----------------------------------------------------------------------

    def slots(self) -> int:
        """The ranks one barrier stage of this run can have at once now (0 where they cannot be counted)."""
        if self.cfg.args.local:
            import os

            return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.view.slots(self.cfg.use_gpu, self.cfg.stage, self.profile)

    def fit(self, size: int | None, wait: float) -> int:
        """``size`` ranks (None: every slot), once their slots are there, waiting up to ``wait`` seconds."""
        return self.view.fit(size, self.cfg.use_gpu, self.cfg.stage, self.profile, wait)

    def wait_for_slots(self, low: int, wait: float) -> int:
        """The slots, once there are at least ``low``, or after ``wait`` seconds."""
        return self.view.wait_for_slots(low, self.cfg.use_gpu, wait, self.cfg.stage, self.profile)

    def leaving(self) -> list[str]:
        """The hosts of executors being decommissioned."""
        return self.view.decommissioning_hosts()

    @property
    def lists_executors(self) -> bool:
        return self.view.lists_executors

    @property
    def local_master(self) -> bool:
        from .cluster import is_local

        return not self.cfg.args.local and is_local(self.view.master)

    # -- what runs --------------------------------------------------------------------------------

    def spec(self, most: int) -> TaskSpec:
        """The spec every rank of every attempt gets, for at most ``most`` ranks: the DataFrames the
        ranks can read from their files leave the stage, the others stay in its input."""
        cfg = self.cfg
        spec = task_spec(cfg, most, self.view.max_result_bytes(), self.view.tails_without_channel)
        spec = dataclasses.replace(spec, user_env={**spec.user_env, worker_env.ELASTIC_ID: self.home_id})
        if self._frames:
            from .scans import file_scans

            scans = file_scans(self._frames, most, cfg.args.storage_options)
            self._frames = {n: df for n, df in self._frames.items() if n not in scans}
            spec = dataclasses.replace(spec, feed=tuple(self._frames), scans=tuple(scans.items()))
        return spec

    def stage_input(self, size: int) -> Any:
        """The barrier stage's input for ``size`` ranks, carrying the fed DataFrames; None without them.
        Built once per size."""
        if not self._frames:
            return None
        if size not in self._inputs:
            from . import feed

            self._inputs[size] = feed.stage_input(self._frames, size)
        return self._inputs[size]

    def job(self, spec: TaskSpec, on_done: Callable[[], None]) -> Job:
        """The job that runs the ranks of one attempt (``spec``); ``on_done`` is called when it ends."""
        return self.view.job(spec, self.cfg.args.fn_name, on_done, self.stage_input(spec.size), self.profile)


def prepare(a: config.Arguments, view: views.ClusterView | None = None) -> Launch:
    """``run``'s checked arguments, ready to launch: on ``view`` (None: chosen from the arguments),
    its settings resolved against the view's conf and what its probes found, its resource profile,
    and its home. A bad setting, or a named run without an ``elastic_url``, raises here."""
    if view is None:
        view = views.choose(a.local, a.size, a.use_gpu)
    values = config.settings_for(a, view.conf)
    cfg = config.resolve(a, view.conf, values, view.meet(values, a.run_id, a.local))
    profile = view.profile(cfg.stage) if cfg.stage is not None else None
    return Launch(view, cfg, profile, _home(cfg))


def _home(cfg: config.RunConfig):
    url, name = cfg.settings.elastic_url, cfg.args.name
    if name and not url:
        raise InvalidArgumentError(
            f"run_id={name!r} names a run whose commits, result and lease live under the elastic_url setting, and "
            "none is set: set it to an fsspec URL every job can reach, e.g. env={'SPARKTRAIN_ELASTIC_URL': "
            "'abfss://container@account.dfs.core.windows.net/runs'} (or the driver's SPARKTRAIN_ELASTIC_URL, or "
            "spark.sparktrain.elasticUrl)")
    if not url:
        return None
    from ...storage.home import Home

    return Home(url, name or cfg.args.run_id, cfg.args.storage_options)
