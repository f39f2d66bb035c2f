"""The :class:`~sparktrain.seam.spec.TaskSpec` a run gives every rank of every attempt: a projection
of its resolved :class:`~sparktrain.driver.launch.config.RunConfig`, reading nothing else."""
from __future__ import annotations

import logging

from ... import settings
from ...seam.spec import TaskSpec
from . import preflight
from .config import RunConfig

log = logging.getLogger("sparktrain")


def settings_env(cfg: RunConfig) -> dict[str, str]:
    """``env=``, with every setting the ranks read that the driver resolved from an argument, ``env=``,
    its environment or the conf (``settings.READ_IN_RANK``) written as its variable in canonical
    form: the driver's value reaches every rank, which parses it once at its start
    (``sparktrain.settings.rank``).
    Encryption is always written: the driver's resolution, 'auto' included, decides it."""
    values, out = cfg.settings, dict(cfg.args.env)
    for name in settings.READ_IN_RANK:
        s = settings.SETTINGS[name]
        if values.origin(name) != "default" and values[name] is not None:
            out[s.env] = settings.as_text(values[name])
    out[settings.SETTINGS["encryption"].env] = "on" if cfg.encrypted else "off"
    return out


def task_spec(cfg: RunConfig, size: int, max_result_bytes: int, tails_without_channel: bool) -> TaskSpec:
    """The spec every rank of every attempt gets; each attempt adds its number and its channel's
    secret. ``tails_without_channel``: the view's (``views.ClusterView``)."""
    a, values = cfg.args, cfg.settings
    spec = TaskSpec(
        run_id=a.run_id, size=size, payload=a.payload, secret=b"",
        driver_address=(cfg.driver_host, 0) if cfg.rendezvous != "barrier" else None,
        use_gpu=cfg.use_gpu, output_ranks=preflight.normalize_output_ranks(a.output_ranks, size),
        max_result_bytes=max_result_bytes, start_timeout=values.start_timeout, grace_period=values.grace_period,
        heartbeat_timeout=values.heartbeat_timeout, stall_warning=values.stall_warning,
        user_env=settings_env(cfg), checkpoint=a.checkpoint, encrypted=cfg.encrypted,
        spill_url=cfg.spill_url, versions=cfg.versions, tf_log_level=0 if a.verbose == 2 else 2,
        feed=tuple(a.frames or ()), return_output=tails_without_channel and cfg.rendezvous == "barrier"
        and cfg.log_target is None, log_target=cfg.log_target, mlflow=cfg.mlflow, task_cpus=cfg.task_cpus,
        nics=_nics(cfg), backend=values.backend, jax_cpu_devices=values.jax_cpu_devices,
        storage_options=cfg.rank_options,
    )
    log.debug("sparktrain: run %s resolved settings: num_proc=%d use_gpu=%s start_timeout=%s timeout=%s "
              "rendezvous=%s grace_period=%s maxResultSize=%d max_attempts=%d capacity_wait=%s spill_url=%s "
              "task_resources=%s task_cpus=%s encrypted=%s", a.run_id, size, cfg.use_gpu, spec.start_timeout,
              a.timeout, cfg.rendezvous, spec.grace_period, spec.max_result_bytes, values.max_attempts,
              cfg.capacity_wait, spec.spill_url, cfg.stage or "default profile", cfg.task_cpus, cfg.encrypted)
    return spec


def _nics(cfg: RunConfig) -> tuple[str, ...] | None:
    """The network the ranks offer each other: the ``nics`` setting; in local mode only as ``run``'s
    argument gives it (the environment's and the conf's name a cluster's network)."""
    return cfg.args.settings.get("nics") if cfg.args.local else cfg.settings.nics
