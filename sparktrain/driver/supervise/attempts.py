"""A run's supervision, one loop for fixed and elastic runs: :func:`supervise` runs a
``Launch`` (``sparktrain.driver.launch.prepare``) under its size policy
(``sparktrain.driver.supervise.policies``) and carries out what the policy decides: sizes each
attempt (waiting for its slots through the launch), starts it (``attempt.Attempt``), lets the
policy look at the slots on the attempt loop's turns where it watches them (``elastic.Lookout``),
and after a failure retries at a size or gives up with the error, which it raises.

A named run's lease and recorded result bracket the attempts (``resume.Named``). Every attempt
shares the run's id and its pickled payload; each gets its number and, from the attempt, its own
secret and channel.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Mapping

from ...errors import InsufficientResourcesError, SparkTrainError
from ...seam.spec import TaskSpec
from . import policies
from .attempt import Attempt, RunInfo
from .resume import Named

if TYPE_CHECKING:
    from ..launch.prepare import Launch

log = logging.getLogger("sparktrain")


def supervise(launch: "Launch", policy: policies.Policy) -> Any:
    """Run ``launch`` under ``policy`` until an attempt succeeds, or the policy gives up; return
    rank 0's value (a named run that finished before: its recorded value, launching nothing)."""
    named = Named(launch)
    finished, value = named.begin()
    if finished:
        return value
    try:
        try:
            with named.running():
                value = Attempts(launch, policy).run()
        except BaseException as e:
            named.failed(e)
            raise
        named.finished(value)
        return value
    finally:
        named.end()


class Attempts:
    """The run's attempts, as the module's doc says."""

    def __init__(self, launch: "Launch", policy: policies.Policy):
        self.launch, self.policy = launch, policy
        a = launch.cfg.args
        self.info = RunInfo(run_id=a.run_id, fn_name=a.fn_name, stdout=a.stdout, stderr=a.stderr,
                            timestamps=a.timestamps, timeout=a.timeout, verbose=a.verbose)

    def run(self) -> Any:
        launch, policy, info = self.launch, self.policy, self.info
        size = self.size(policy.start(None, None))
        spec = launch.spec(policy.most(size))
        launch.stage_input(size)  # a fixed run's input is built before anything launches
        info.display.attach(log)
        info.display.logged = spec.log_target is not None
        earlier: list[str] = []
        number = 0
        while True:
            number += 1
            if number > 1:
                info.display.hosts.clear()
            attempt = attempt_spec(spec, number, size, policy.attempts, policy.env(number))
            info.display.size = size
            if attempt.output_ranks is not None:
                info.display.live_ranks = attempt.output_ranks
            lookout = self.lookout(number, size)
            try:
                value = Attempt(info, attempt, policy.attempts, launch.job, launch.cfg.driver_host,
                                lookout.look if lookout is not None else (lambda: None)).supervise()
            except SparkTrainError as e:
                out_of_time = info.timeout is not None and info.elapsed() >= info.timeout
                resize = lookout.resize if lookout is not None else None
                decision = policy.after_failure(e, number, out_of_time, list(earlier), resize)
                if isinstance(decision, policies.GiveUp):
                    info.display.finish(f"failed: {policies.first_line(str(decision.error))[:200]}")
                    if decision.error is e:
                        raise
                    raise decision.error from e
                earlier.append(policies.first_line(str(e)))
                size = self.retry(number, decision, size)
                continue
            if number > 1:
                log.warning("sparktrain: run %s succeeded on attempt %d%s, after %d failed attempt(s)", info.run_id,
                            number, of(policy.attempts), number - 1)
            info.display.finish()
            return value

    def retry(self, failed: int, retry: policies.Retry, size: int) -> int:
        """The size of the attempt after attempt ``failed``, once its slots are there."""
        start = self.policy.start(retry, size)
        if start.exact:
            log.warning("sparktrain: run %s attempt %d%s failed: %s; starting all %d ranks again", self.info.run_id,
                        failed, of(self.policy.attempts), retry.why, start.want)
        return self.size(start)

    def size(self, start: policies.Start) -> int:
        """Carry out ``start``: the ranks it asks for, once their slots are there."""
        launch = self.launch
        if start.exact:
            return launch.fit(start.want, start.wait)
        from . import elastic

        if start.settle:
            elastic.settle(launch)
        want, why = start.want, start.why + (elastic.resumes_from(launch.home) if start.why else "")
        while True:
            size = elastic.wait_for(launch, start, want, why)
            try:  # the slots may go between the count and the launch
                return launch.fit(size, launch.cfg.capacity_wait)
            except InsufficientResourcesError as e:
                want, why = start.low, f"the slots went while it launched ({e})"

    def lookout(self, number: int, size: int):
        """What the attempt's loop looks at on its turns, where the policy watches the slots."""
        if not self.policy.watches:
            return None
        from . import elastic

        return elastic.Lookout(self.launch.slots, self.launch.leaving, size, self.policy,
                               lambda resize: elastic.mark(self.launch.home, number, resize))


def attempt_spec(spec: TaskSpec, number: int, size: int, attempts: int, env: Mapping[str, str]) -> TaskSpec:
    """Attempt ``number``'s spec: the run's, at ``size`` ranks, with ``env`` added to its ranks' environment."""
    ranks = spec.output_ranks if spec.output_ranks is None else frozenset(r for r in spec.output_ranks if r < size)
    return dataclasses.replace(spec, size=size, attempt=number, max_attempts=attempts, output_ranks=ranks,
                               user_env={**spec.user_env, **env})


def of(attempts: int) -> str:
    """`` of N`` after an attempt's number, where the run has a bound."""
    return f" of {attempts}" if attempts else ""
