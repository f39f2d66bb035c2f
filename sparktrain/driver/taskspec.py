"""The :class:`~sparktrain.spec.TaskSpec` a run gives every rank of every attempt, from its
arguments and resolved settings (``sparktrain.driver.run`` validates them first)."""
from __future__ import annotations

import logging
import os
from typing import Mapping

from .. import settings, tracking, versions
from ..spec import TaskSpec
from .attempt import RunInfo

log = logging.getLogger("sparktrain")


def task_spec(info: RunInfo, *, size: int, payload: bytes, driver_address: tuple[str, int] | None, use_gpu: bool,
              output_ranks: frozenset[int] | None, max_result_bytes: int, env: Mapping[str, str],
              conf: Mapping[str, str], checkpoint: bytes | None, start_timeout: float | None,
              spill_url: str | None = None, feed: tuple[str, ...] = (), return_output: bool = False,
              log_target: bytes | None = None, task_cpus: int | None = None,
              nics: tuple[str, ...] | None = None, encryption: str | None = None) -> TaskSpec:
    """The spec every rank of every attempt gets; each attempt adds its number and its channel's secret."""
    environ = {**os.environ, **(env or {})}
    settings.warn_retired(conf, environ)
    encrypted = settings.encrypted(encryption, conf=conf, environ=environ)
    user_env = {**settings.rank_env(env, conf), settings.SETTINGS["encryption"].env: "on" if encrypted else "off"}
    return TaskSpec(
        run_id=info.run_id, size=size, payload=payload, secret=b"", driver_address=driver_address,
        use_gpu=use_gpu, output_ranks=output_ranks, max_result_bytes=max_result_bytes,
        start_timeout=settings.resolve("start_timeout", start_timeout, conf=conf),
        grace_period=settings.resolve("grace_period", conf=conf),
        heartbeat_timeout=settings.resolve("heartbeat_timeout", conf=conf),
        stall_warning=settings.resolve("stall_warning", environ=environ, conf=conf),
        user_env=user_env, checkpoint=checkpoint, encrypted=encrypted,
        spill_url=spill_url, versions=versions.collect(), tf_log_level=0 if info.verbose == 2 else 2, feed=feed,
        return_output=return_output, log_target=log_target,
        mlflow=_mlflow_handoff(info.run_id, env), task_cpus=task_cpus, nics=nics,
    )


def _mlflow_handoff(run_id: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """What rank 0 needs to log into the driver's MLflow run (``sparktrain.tracking``); None without MLflow."""
    handoff = tracking.mlflow_handoff(user_env=env)
    if handoff:
        log.debug("sparktrain: run %s: rank 0 logs to MLflow %s", run_id, tracking.describe(handoff))
    return handoff or None
