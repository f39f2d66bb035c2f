"""A run's attempts, one loop for fixed and elastic runs: start an attempt
(``sparktrain.driver.supervise.attempt``), and when it fails, do what the supervision core decides
(``supervision.after_failure``): retry at a size, or give up with an error, which this loop raises.

What differs between the two is a value. Before launch, a :class:`Plan` (``run``'s
:class:`FixedPlan`, ``run_elastic``'s ``sparktrain.driver.supervise.elastic.ElasticPlan``) gives the
run's pipeline (``sparktrain.driver.run.pipeline``) the view it needs, checks its sizes, and gives its
:class:`Sized`: the size policy (``supervision.Fixed`` or ``supervision.Elastic``) and a
:class:`Sizer`, the size of each attempt and the wait for its slots, what the attempt's loop looks at
on its turns while it runs (:class:`Watching`), and what its ranks find in their environment.
Every attempt shares the run's id and its pickled payload; each gets its number and, from the
attempt, its own secret and channel.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Protocol

from ...errors import SparkTrainError
from ...seam.spec import TaskSpec
from . import supervision as core
from .attempt import Attempt, RunInfo
from ..launch import views
from ..launch.config import RunConfig
from ..launch.jobs import JobFactory

log = logging.getLogger("sparktrain")

#: Seconds a retry waits at most for the cluster to offer every slot again (a lost executor's
#: replacement registers within seconds on standalone, YARN and Kubernetes).
RETRY_CAPACITY_WAIT = 60.0


class Watching(Protocol):
    """What the driver watches while an attempt runs: :meth:`look`, on each turn of the attempt's
    loop, looks when its own interval says so; :attr:`resize`, what the driver asked of the ranks
    (an elastic resize, set once its marker is written), if anything."""

    resize: core.Resize | None

    def look(self) -> None:
        """Look, if it is time to."""


class Sizer(Protocol):
    """A size policy's I/O: see the module's doc."""

    def size(self, number: int, retry: core.Retry | None) -> int:
        """The size of attempt ``number``, once its slots are there; ``retry``: why the last one failed."""

    def watch(self, number: int, size: int) -> Watching:
        """What the driver watches while attempt ``number`` of ``size`` ranks runs."""

    def env(self, number: int) -> Mapping[str, str]:
        """What attempt ``number``'s ranks find in their environment besides the run's."""


@dataclasses.dataclass(frozen=True)
class NotWatched:
    resize: core.Resize | None = None

    def look(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Sized:
    """A run's sizes, on its lease: its size policy, its attempts' sizer, the stage's resource
    profile, the most ranks an attempt has (the spec's size), and what every rank finds in its
    environment besides the run's settings."""

    policy: core.Policy
    sizer: Sizer
    profile: Any
    most: int
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


class Plan(Protocol):
    """What differs between ``run`` and ``run_elastic`` before launch, asked by the one pipeline."""

    def session(self) -> views.ClusterView | None:
        """The view, where it is found before the arguments are checked; None: chosen from them."""

    def checked(self, cfg: RunConfig, view: views.ClusterView) -> Callable[[], Sized]:
        """What must be checked before the run's lease, checked; returns the step that sizes the
        run under its lease."""


class FixedPlan:
    """``run``'s: the view chosen from the arguments; on the lease, ``num_proc`` ranks (None: every
    slot) fitted to the slots, waiting up to ``capacity_wait``; up to ``max_attempts`` attempts."""

    def session(self) -> None:
        return None

    def checked(self, cfg: RunConfig, view: views.ClusterView) -> Callable[[], Sized]:
        return lambda: self.sized(cfg, view)

    @staticmethod
    def sized(cfg: RunConfig, view: views.ClusterView) -> Sized:
        profile = view.profile(cfg.stage) if cfg.stage is not None else None
        size = view.fit(cfg.args.size, cfg.use_gpu, cfg.stage, profile, cfg.capacity_wait)
        policy = core.Fixed(size, cfg.settings.max_attempts)
        # A lost executor is usually replaced within seconds; a retried gang needs all its slots back.
        retry_wait = max(RETRY_CAPACITY_WAIT, cfg.capacity_wait)
        refit = lambda: view.fit(size, cfg.use_gpu, cfg.stage, profile, retry_wait)  # noqa: E731
        return Sized(policy, FixedSize(cfg.args.run_id, policy, refit), profile, size)


class FixedSize:
    """``run``'s attempts: all ``policy.size`` ranks each time; before a retry, ``refit`` waits
    for the slots of all of them again."""

    def __init__(self, run_id: str, policy: core.Fixed, refit: Callable[[], None] = lambda: None):
        self.run_id, self.policy, self.refit = run_id, policy, refit

    def size(self, number: int, retry: core.Retry | None) -> int:
        if retry is not None:
            log.warning("sparktrain: run %s attempt %d of %d failed: %s; starting all %d ranks again",
                        self.run_id, number - 1, self.policy.max_attempts, retry.why, self.policy.size)
            self.refit()
        return self.policy.size

    def watch(self, number: int, size: int) -> Watching:
        return NotWatched()

    def env(self, number: int) -> Mapping[str, str]:
        return {}


def run_attempts(info: RunInfo, spec: TaskSpec, make_job: JobFactory, host: str, policy: core.Policy,
                 sizer: Sizer | None = None) -> Any:
    """Start attempts of ``spec`` until one succeeds, or the core gives up; return rank 0's value.

    ``spec.output_ranks`` holds for the largest size; an attempt of fewer ranks shows those of them
    it has. Without a ``sizer``, ``policy`` must be :class:`~supervision.Fixed` (retries wait for nothing)."""
    sizer = sizer if sizer is not None else FixedSize(info.run_id, policy)
    info.display.logged = spec.log_target is not None
    earlier: list[str] = []
    retry: core.Retry | None = None
    number = 0
    while True:
        number += 1
        size = sizer.size(number, retry)
        if number > 1:
            info.display.hosts.clear()
        attempt = attempt_spec(spec, number, size, policy.attempts, sizer.env(number))
        info.display.size = size
        if attempt.output_ranks is not None:
            info.display.live_ranks = attempt.output_ranks
        # Looked at on the attempt loop's turns: its resize is set there, after its marker is written.
        watching = sizer.watch(number, size)
        try:
            value = Attempt(info, attempt, policy.attempts, make_job, host, watching.look).supervise()
        except SparkTrainError as e:
            out_of_time = info.timeout is not None and info.elapsed() >= info.timeout
            decision = core.after_failure(policy, e, number, out_of_time, earlier, watching.resize)
            if isinstance(decision, core.GiveUp):
                info.display.finish(f"failed: {core.first_line(str(decision.error))[:200]}")
                if decision.error is e:
                    raise
                raise decision.error from e
            earlier.append(core.first_line(str(e)))
            retry = decision
            continue
        if number > 1:
            log.warning("sparktrain: run %s succeeded on attempt %d%s, after %d failed attempt(s)", info.run_id,
                        number, of(policy.attempts), number - 1)
        info.display.finish()
        return value


def attempt_spec(spec: TaskSpec, number: int, size: int, attempts: int, env: Mapping[str, str]) -> TaskSpec:
    """Attempt ``number``'s spec: the run's, at ``size`` ranks, with ``env`` added to its ranks' environment."""
    ranks = spec.output_ranks if spec.output_ranks is None else frozenset(r for r in spec.output_ranks if r < size)
    return dataclasses.replace(spec, size=size, attempt=number, max_attempts=attempts, output_ranks=ranks,
                               user_env={**spec.user_env, **env})


def of(attempts: int) -> str:
    """`` of N`` after an attempt's number, where the run has a bound."""
    return f" of {attempts}" if attempts else ""
