"""The :class:`~sparktrain.spec.TaskSpec` a run gives every rank of every attempt, from its
resolved :class:`~sparktrain.driver.config.RunConfig`."""
from __future__ import annotations

import logging
import os
from typing import Mapping

from .. import settings, tracking, versions
from ..spec import TaskSpec
from . import preflight
from .config import RunConfig

log = logging.getLogger("sparktrain")


def task_spec(cfg: RunConfig, size: int, max_result_bytes: int, tails_without_channel: bool) -> TaskSpec:
    """The spec every rank of every attempt gets; each attempt adds its number and its channel's
    secret. ``tails_without_channel``: the view's (``views.ClusterView``)."""
    a, conf = cfg.args, cfg.conf
    environ = {**os.environ, **a.env}
    settings.warn_retired(conf, environ)
    user_env = {**settings.rank_env(a.env, conf), settings.SETTINGS["encryption"].env: "on" if cfg.encrypted else "off"}
    legacy_keras = settings.resolve("legacy_keras", environ=environ, conf=conf)
    if legacy_keras is not None:  # tf.keras is decided in the rank's process, from its environment
        user_env[settings.SETTINGS["legacy_keras"].env] = "1" if legacy_keras else "0"
    spec = TaskSpec(
        run_id=a.run_id, size=size, payload=a.payload, secret=b"",
        driver_address=(cfg.driver_host, 0) if cfg.rendezvous != "barrier" else None,
        use_gpu=cfg.use_gpu, output_ranks=preflight.normalize_output_ranks(a.output_ranks, size),
        max_result_bytes=max_result_bytes,
        start_timeout=settings.resolve("start_timeout", a.start_timeout, conf=conf),
        grace_period=settings.resolve("grace_period", conf=conf),
        heartbeat_timeout=settings.resolve("heartbeat_timeout", conf=conf),
        stall_warning=settings.resolve("stall_warning", environ=environ, conf=conf),
        user_env=user_env, checkpoint=a.checkpoint, encrypted=cfg.encrypted,
        spill_url=cfg.spill_url, versions=versions.collect(), tf_log_level=0 if a.verbose == 2 else 2,
        feed=tuple(a.frames or ()), return_output=tails_without_channel and cfg.rendezvous == "barrier"
        and cfg.log_target is None, log_target=cfg.log_target,
        mlflow=_mlflow_handoff(a.run_id, a.env), task_cpus=cfg.task_cpus, nics=a.nics,
        backend=settings.resolve("backend", a.backend, environ=environ, conf=conf),
        jax_cpu_devices=settings.resolve("jax_cpu_devices", environ=environ, conf=conf),
    )
    log.debug("sparktrain: run %s resolved settings: num_proc=%d use_gpu=%s start_timeout=%s timeout=%s "
              "rendezvous=%s grace_period=%s maxResultSize=%d max_attempts=%d capacity_wait=%s spill_url=%s "
              "task_resources=%s task_cpus=%s encrypted=%s", a.run_id, size, cfg.use_gpu, spec.start_timeout,
              a.timeout, cfg.rendezvous, spec.grace_period, spec.max_result_bytes, cfg.max_attempts,
              cfg.capacity_wait, spec.spill_url, cfg.stage or "default profile", cfg.task_cpus, cfg.encrypted)
    return spec


def _mlflow_handoff(run_id: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """What rank 0 needs to log into the driver's MLflow run (``sparktrain.tracking``); None without MLflow."""
    handoff = tracking.mlflow_handoff(user_env=env)
    if handoff:
        log.debug("sparktrain: run %s: rank 0 logs to MLflow %s", run_id, tracking.describe(handoff))
    return handoff or None
