"""A run's attempts, one loop for fixed and elastic runs: start an attempt
(``sparktrain.driver.supervise.attempt``), and when it fails, do what the supervision core decides
(``supervision.after_failure``): retry at a size, or give up with an error, which this loop raises.

What differs between the two is a :class:`Sizer`: the size of each attempt and the wait for its
slots, what the driver watches while it runs, and what its ranks find in their environment.
:class:`FixedSize` serves ``run``; ``sparktrain.driver.supervise.elastic.ElasticSize`` serves ``run_elastic``.
Every attempt shares the run's id and its pickled payload; each gets its number and, from the
attempt, its own secret and channel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, ContextManager, Mapping, Protocol

from ...errors import SparkTrainError
from ...seam.spec import TaskSpec
from . import supervision as core
from .attempt import Attempt, RunInfo
from ..launch.jobs import JobFactory

log = logging.getLogger("sparktrain")


class Watching(Protocol):
    """What the driver asked of the ranks of the running attempt (an elastic resize), if anything."""

    resize: core.Resize | None


class Sizer(Protocol):
    """A size policy's I/O: see the module's doc."""

    def size(self, number: int, retry: core.Retry | None) -> int:
        """The size of attempt ``number``, once its slots are there; ``retry``: why the last one failed."""

    def watch(self, number: int, size: int) -> ContextManager[Watching]:
        """What the driver watches while attempt ``number`` of ``size`` ranks runs."""

    def env(self, number: int) -> Mapping[str, str]:
        """What attempt ``number``'s ranks find in their environment besides the run's."""


@dataclasses.dataclass(frozen=True)
class NotWatched:
    resize: core.Resize | None = None


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

    def watch(self, number: int, size: int) -> ContextManager[Watching]:
        return contextlib.nullcontext(NotWatched())

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
        with sizer.watch(number, size) as watching:
            try:
                value = Attempt(info, attempt, policy.attempts, make_job, host).supervise()
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
