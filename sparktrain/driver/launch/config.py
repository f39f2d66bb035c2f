"""A run's settings, resolved once: :func:`check_arguments` before any session, then
:func:`resolve` against the cluster view's conf, into one frozen :class:`RunConfig`.

The order in which a setting is read (argument, ``env=``, the driver's environment, the Spark
conf, the default) is the settings table's (``sparktrain.settings``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from typing import IO, Any, Callable, Mapping

from ...seam import payload as payloads
from ... import settings
from ...seam import tracking, versions
from ...errors import InvalidArgumentError, PicklingFailedError
from . import capacity, cluster, preflight
from .capacity import TaskResources

log = logging.getLogger("sparktrain")


@dataclasses.dataclass(frozen=True)
class Arguments:
    """``run``'s arguments, checked, with nothing asked of a cluster yet."""

    run_id: str
    fn_name: str
    payload: bytes
    size: int | None
    local: bool
    env: dict[str, str]
    stdout: IO[str] | None
    stderr: IO[str] | None
    verbose: int
    timestamps: bool
    use_gpu: bool | None
    asked: TaskResources | None
    output_ranks: Any
    #: ``checkpoint_url``, checked: its scheme and backend work here.
    checkpoint: str | None
    storage_options: Mapping[str, Any] | None
    frames: dict[str, Any] | None
    #: The settings given as ``run``'s arguments (``start_timeout``, ``max_attempts``, ``nics``,
    #: ``encryption``, ``backend``, ``log_url``), each parsed as the settings table parses it, by
    #: name; an argument not given is not there. :func:`resolve` puts them first.
    settings: Mapping[str, Any]
    timeout: float | None
    #: The run's name (``run_id=``): its home is ``<elastic_url>/<name>/``; None for an unnamed run.
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run's attempts need to know, resolved against the cluster's conf: each fact once.

    The settings are in :attr:`settings`, a typed frozen record (``sparktrain.settings.Settings``);
    the other fields are what follows from them and the cluster."""

    args: Arguments
    conf: Mapping[str, str]
    #: Every setting of the table, resolved once against the arguments, ``env=``, the driver's
    #: environment and the conf; the ranks' spec is projected from it.
    settings: settings.Settings
    #: Where the ranks reach this process.
    driver_host: str
    #: How ranks meet: "driver" (its channel) or "barrier" (Spark's allGather): the ``rendezvous``
    #: setting, with "auto" decided for the view.
    rendezvous: str
    use_gpu: bool
    #: The run's own task resources (a ResourceProfile), or None for the application's default.
    stage: TaskResources | None
    task_cpus: int | None
    #: The ``log_url`` setting, checked; None in local mode.
    log_target: str | None
    #: Where rank 0 spills a value too large for Spark's result path: the ``spill_url`` setting, or
    #: this host's temporary directory on a local master; None: it fails instead.
    spill_url: str | None
    #: Whether the channel and the ring between hosts are encrypted (the ``encryption`` setting).
    encrypted: bool
    #: The driver's versions (``sparktrain.seam.versions``) and its MLflow hand-off for rank 0.
    versions: dict | None = None
    mlflow: dict | None = None
    #: ``run``'s ``storage_options``, pickled once for the ranks (``TaskSpec.storage_options``).
    rank_options: bytes | None = dataclasses.field(default=None, repr=False)

    @property
    def master(self) -> str:
        return self.conf.get("spark.master", "")

    @property
    def capacity_wait(self) -> float:
        """Seconds to wait for the cluster's slots: the ``capacity_wait`` setting; none in local mode."""
        return 0.0 if self.args.local else self.settings.capacity_wait


def check_arguments(train_fn: Callable[..., Any], args, kwargs, num_proc, local_mode, start_timeout, timeout, env,
                    stdout, stderr, verbose, prefix_output_with_timestamp, use_gpu, output_ranks, checkpoint_url,
                    storage_options, max_attempts, data, log_url, resources, nics, encryption=None,
                    backend=None, run_id=None) -> Arguments:
    """Check every argument of ``run``; a bad one raises, naming the value and the fix."""
    size, local = preflight.check_num_proc(num_proc, local_mode)
    args, kwargs, env = preflight.check_arguments(
        train_fn, args, kwargs, env, stdout, stderr, verbose, prefix_output_with_timestamp, use_gpu, output_ranks)
    asked = capacity.check_resources(resources, use_gpu)
    settings.check_environ({**os.environ, **env})  # a bad value fails here, before any session
    start_timeout = settings.parse_seconds("start_timeout", start_timeout, allow_none=True)
    timeout = settings.parse_seconds("timeout", timeout, allow_none=True)
    given = {name: value if name in ("start_timeout", "log_url") else settings.parse_value(name, value)
             for name, value in (("start_timeout", start_timeout), ("max_attempts", max_attempts), ("nics", nics),
                                 ("encryption", encryption), ("backend", backend), ("log_url", log_url))
             if value is not None}
    if local and data is not None:
        raise InvalidArgumentError(
            "data= feeds a DataFrame through the run's Spark stage, and local mode runs without Spark. Use "
            "num_proc > 0 (on a local[N] master for one machine), or read the data inside train_fn")
    if local and asked is not None and asked.gpus not in (None, 0.0, 1.0):
        raise InvalidArgumentError(
            f"local mode gives each rank one GPU of this machine, or none; resources['gpus']={resources['gpus']!r} "
            "cannot be met. Ask for 'gpus': 1 or 0, or run on Spark (num_proc > 0)")
    if local and asked is not None and asked.gpus:
        use_gpu = True
    checkpoint = _checked(checkpoint_url, storage_options)
    if run_id is not None:
        from ...storage.home import check_run_id

        run_id = check_run_id(run_id)
    frames = None
    if data is not None:
        from . import feed

        frames = feed.frames_of(data)
    return Arguments(
        run_id=uuid.uuid4().hex[:12], fn_name=getattr(train_fn, "__qualname__", type(train_fn).__name__),
        payload=preflight.pickle_payload(train_fn, args, kwargs, payloads.dumps), size=size, local=local, env=env,
        stdout=stdout, stderr=stderr, verbose=verbose, timestamps=prefix_output_with_timestamp, use_gpu=use_gpu,
        asked=asked, output_ranks=output_ranks, checkpoint=checkpoint, storage_options=storage_options,
        frames=frames, settings=given, timeout=timeout, name=run_id)


def settings_of(conf: Mapping[str, str], environ: Mapping[str, str] | None = None,
                arguments: Mapping[str, Any] | None = None) -> settings.Settings:
    """Every setting, resolved once: ``arguments`` > ``environ`` (the driver's environment with
    ``env=`` over it) > ``conf`` > the default. A bad value raises naming where it came from."""
    return settings.resolve_all(arguments, conf=conf, environ=os.environ if environ is None else environ)


def settings_for(a: Arguments, conf: Mapping[str, str]) -> settings.Settings:
    """The run's settings against ``conf``; refuses, before any probe, a bad value of a setting
    and a conf the run cannot work with."""
    environ = {**os.environ, **a.env}
    values = settings_of(conf, environ, a.settings)
    settings.warn_retired(conf, environ)
    if not a.local:
        encrypted = settings.encrypts(values.encryption, conf)
        preflight.check_cluster_conf(conf, values.allow_unencrypted, encrypted, values.cpu_collectives)
    return values


@dataclasses.dataclass(frozen=True)
class Met:
    """What the view's probes found for a run (``views.ClusterView.meet``): where the ranks reach
    this process, and how they meet ("driver": its channel; "barrier": Spark's allGather)."""

    driver_host: str = "127.0.0.1"
    rendezvous: str = "driver"


def resolve(a: Arguments, conf: Mapping[str, str], values: settings.Settings, met: Met) -> RunConfig:
    """The run's config from its arguments, the view's ``conf``, its settings (:func:`settings_for`)
    and what the view's probes found; reads nothing else."""
    encrypted = settings.encrypts(values.encryption, conf)
    common = dict(settings=values, encrypted=encrypted, versions=versions.collect(),
                  mlflow=_mlflow_handoff(a.run_id, a.env),
                  rank_options=_rank_options(values.elastic_url, a.storage_options))
    if a.local:
        return RunConfig(args=a, conf=conf, driver_host="127.0.0.1", rendezvous="driver", use_gpu=bool(a.use_gpu),
                         stage=None, task_cpus=a.asked.cpus if a.asked is not None else None, log_target=None,
                         spill_url=None, **common)
    use_gpu = a.use_gpu
    if use_gpu is None:
        use_gpu = bool(a.asked.gpus) if a.asked is not None and a.asked.gpus is not None \
            else capacity.gpu_amount(conf) > 0
    master = conf.get("spark.master", "")
    local_master = cluster.is_local(master)
    stage = capacity.stage_resources(conf, a.asked, use_gpu, local_master)
    if stage is None:
        capacity.check_gpu_conf(conf, use_gpu)
    # A local master's task cpus are a count of slots, not of cores: threads follow only a cluster's.
    task_cpus = stage.cpus if stage is not None else \
        None if local_master else capacity.default_task_resources(conf).cpus
    return RunConfig(
        args=a, conf=conf, driver_host=met.driver_host, rendezvous=met.rendezvous, use_gpu=use_gpu, stage=stage,
        task_cpus=task_cpus, log_target=_checked(values.log_url, a.storage_options),
        spill_url=_spill_url(master, values.spill_url), **common)


def _mlflow_handoff(run_id: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """What rank 0 needs to log into the driver's MLflow run (``sparktrain.seam.tracking``); None without MLflow."""
    handoff = tracking.mlflow_handoff(user_env=env)
    if handoff:
        log.debug("sparktrain: run %s: rank 0 logs to MLflow %s", run_id, tracking.describe(handoff))
    return handoff or None


def elastic_settings(cfg: RunConfig) -> tuple[str, float]:
    """``run_elastic``'s settings: where commits and resize markers go (``elastic_url``; "" where
    none is set), and how long slots for more ranks must last before an attempt grows."""
    return cfg.settings.elastic_url or "", cfg.settings.elastic_grow_after


def _checked(url: str | None, storage_options: Mapping[str, Any] | None) -> str | None:
    """``url`` (``checkpoint_url``, ``log_url``), once its scheme and backend are known to work here."""
    if url:
        from ... import storage

        storage.check_url(url, storage_options)  # an unknown scheme or missing backend fails here
    return url or None


def _rank_options(elastic_url: str | None, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """``storage_options`` pickled once for every rank: the run's home under ``elastic_url`` (its
    scheme checked here), rank 0's ``checkpoint_url``, the ``log_url`` and a fed scan's files use
    them. None without them: the ranks then use the credentials of their own environment."""
    if not storage_options:
        return None
    _checked(elastic_url, storage_options)
    import cloudpickle

    try:
        return cloudpickle.dumps(dict(storage_options))
    except Exception as e:  # noqa: BLE001
        raise PicklingFailedError(
            f"storage_options cannot be pickled for the ranks ({type(e).__name__}): give values that pickle, such "
            "as strings, numbers and credential objects of classes the executors can import") from None


def _spill_url(master: str, url: str | None) -> str | None:
    """Where rank 0 spills a value too large for Spark's result path (the ``spill_url`` setting);
    None: it fails instead."""
    if url == "":
        return None  # spilling turned off
    if url is None and cluster.on_this_host(master):
        # Executors and driver share this machine's disk.
        import tempfile

        url = "file://" + os.path.join(tempfile.gettempdir(), f"sparktrain-spill-{os.geteuid()}")  # this user's
    if url is not None:
        from ... import storage

        storage.check_url(url)
    return url
