"""The public ``sparktrain.run`` and ``sparktrain.run_elastic``, as one pipeline (:func:`pipeline`):
check the arguments, choose the cluster view, resolve the settings against its conf
(``driver.launch.config``), size the ranks to its slots, build the ranks' spec, and hand over to the
attempts (``driver.supervise.attempts``). What differs is a value, the run's plan: ``run``'s
(``attempts.FixedPlan``, a fixed size policy) or ``run_elastic``'s (``elastic.ElasticPlan``).

pyspark is imported inside the functions that need it, so ``import sparktrain`` stays fast
and works where only the worker API is used. The flow of a run, and which module does what,
is drawn in docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from typing import IO, Any, Callable, Iterable, Mapping

from .launch import config, views
from .launch.taskspec import task_spec
from .supervise import resume
from .supervise import supervision as core
from .supervise.attempt import RunInfo
from .supervise.attempts import FixedPlan, Plan, Sizer, run_attempts

log = logging.getLogger("sparktrain")


def configure_logging(verbose: int) -> None:
    log.setLevel({0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}[verbose])
    # A library should not configure logging, but a notebook user must see what run() says.
    # Attach a handler only when nobody configured one anywhere.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


def run(
    train_fn: Callable[..., Any],
    args: tuple | list = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    prefix_output_with_timestamp: bool = False,
    *,
    use_gpu: bool | None = None,
    local_mode: bool = False,
    timeout: float | None = None,
    output_ranks: int | Iterable[int] | str | None = None,
    checkpoint_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_attempts: int | None = None,
    data: Any = None,
    log_url: str | None = None,
    resources: Mapping[str, float] | None = None,
    nics: str | Iterable[str] | None = None,
    encryption: str | None = None,
    backend: str | None = None,
    run_id: str | None = None,
) -> Any:
    """Run ``train_fn(*args, **kwargs)`` on ``num_proc`` ranks at once and return rank 0's value.

    Each rank is a fresh Python process started by one task of one barrier-mode Spark stage, its rank,
    size and collective addresses in its environment (docs/env-contract.md); its output streams here
    live. docs/run.md gives every parameter in full, and the settings that also come from the conf.

    Parameters
    ----------
    train_fn, args, kwargs : the function each rank runs, and its arguments (pickled with cloudpickle).
    num_proc, local_mode : ranks (None: every task slot); negative, or ``local_mode=True``: that many
        processes here, without Spark.
    start_timeout : seconds for every rank to check in (default 600). timeout : for the whole run.
    env : extra environment variables for every rank (rank 0 also gets the driver's MLflow run).
    stdout, stderr, verbose, prefix_output_with_timestamp, output_ranks : where ranks' output goes,
        how much the run says (0, 1, 2), a time before each line, which ranks' output to show.
    use_gpu : one GPU per rank; None: as ``spark.task.resource.gpu.amount`` (or ``resources``) says.
    checkpoint_url, storage_options : send rank 0's bytes or files straight to this fsspec URL and
        return the URL; the backend's credentials (never logged), which also serve ``log_url`` and
        the run's home under ``elastic_url`` (the driver's and every rank's reads and writes there).
    max_attempts : how many times to start the whole gang when an attempt fails (default 1).
    data : a DataFrame, or a dict of them by name, fed to the ranks (docs/dataframes.md).
    log_url : an fsspec URL where every rank also writes its output (docs/connect.md).
    resources : what each rank's task holds for this run only, ``{"cpus": 4, "gpus": 1}``.
    nics : the network for the driver's channel and the ranks' ring, as Horovod's ``nics``.
    encryption : "auto" (default: on where Spark's own encryption is), "on" or "off": AES-256-GCM
        on the driver's channel and the ring between hosts, keyed from the run's secret (docs/security.md).
    backend : the ranks' Keras backend; "jax" runs Keras 3 on JAX (docs/jax.md). None: the driver's ``KERAS_BACKEND``.
    run_id : the run's name: its home is ``<elastic_url>/<run_id>/``, where ``hvd.elastic`` commits; a later job
        with the same name resumes from the last commit, or returns the recorded result of a run that finished
        (docs/elastic.md, "Resuming in a new job"). None: a fresh id for every call.

    Returns rank 0's value, or ``checkpoint_url``. Raises InvalidArgumentError,
    PicklingFailedError, ClusterConfigError or InsufficientResourcesError before anything
    launches; RankFailedError (keyed by rank, root cause first, with remote tracebacks),
    StartTimeoutError, RunTimeoutError, RunCancelledError or ResultTooLargeError after.

    >>> sparktrain.run(lambda lr: f"rank {sparktrain.rank()} at {lr}", args=(0.1,), num_proc=3)  # doctest: +SKIP
    'rank 0 at 0.1'
    """
    given = dict(locals())  # every parameter, by its name
    return pipeline(FixedPlan(), lambda: config.check_arguments(**given))


def run_elastic(train_fn: Callable[..., Any], args: tuple | list = (), kwargs: Mapping[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: Mapping[str, str] | None = None, stdout=None, stderr=None,
                verbose: int = 1, prefix_output_with_timestamp: bool = False, **run_kwargs: Any) -> Any:
    """Run ``train_fn`` on ``num_proc`` ranks, and go on with fewer (down to ``min_num_proc``) when
    ranks or hosts are lost; returns rank 0's value. Horovod's ``horovod.spark.run_elastic``.

    Parameters
    ----------
    num_proc : ranks of the first attempt; default ``max_num_proc``, else every slot.
    min_num_proc : the fewest ranks an attempt may have; default ``num_proc``.
    max_num_proc : the most; default ``num_proc``.
    elastic_timeout : seconds an attempt waits for ``min_num_proc`` slots (default 600).
    reset_limit : the most restarts, of any kind; None: no limit.
    Every other keyword is ``sparktrain.run``'s, except ``max_attempts``; ``timeout`` bounds the whole
    run, every attempt together. ``train_fn`` keeps its state with ``hvd.elastic``
    (``state.commit()``, ``@hvd.elastic.run``), and the ``elastic_url`` setting
    (``SPARKTRAIN_ELASTIC_URL`` in ``env=`` or the driver's environment, or
    ``spark.sparktrain.elasticUrl``) says where the commits go: under ``run_id`` where it is given, so
    that a later job with that ``run_id`` resumes from them (docs/elastic.md, "Resuming in a new job").
    """
    from .supervise import elastic

    plan = elastic.plan(num_proc, min_num_proc, max_num_proc, elastic_timeout, reset_limit, run_kwargs)
    return pipeline(plan, lambda: arguments(train_fn, args, kwargs, num_proc, start_timeout, env, stdout, stderr,
                                            verbose, prefix_output_with_timestamp, **run_kwargs))


def pipeline(plan: Plan, check: Callable[[], config.Arguments]) -> Any:
    """``run``'s and ``run_elastic``'s steps, in this order, what differs between them asked of
    ``plan`` (``attempts.Plan``): its view, where it is found before the arguments (``run_elastic``
    needs a classic session); the arguments, checked by ``check``; the view chosen from them
    otherwise; the settings resolved against its conf; what the plan checks before the run's lease
    (``run_elastic``: the ``elastic_url`` setting, and its sizes from the slots); then, under the
    lease of a named run (``resume.run_named``), the plan's sizes, the ranks' spec, and the attempts."""
    view = plan.session()
    a = check()
    configure_logging(a.verbose)
    if view is None:
        view = views.choose(a.local, a.size, a.use_gpu)
    cfg = config.resolve(a, view)
    sized = plan.checked(cfg, view)

    def launch() -> Any:
        s = sized()
        spec = task_spec(cfg, s.most, view.max_result_bytes(), view.tails_without_channel)
        spec = dataclasses.replace(spec, user_env={**spec.user_env, **s.env})
        return attempts(cfg, view, s.profile, spec, s.policy, s.sizer)

    return resume.run_named(cfg, launch)


def arguments(*args: Any, **kwargs: Any) -> config.Arguments:
    """``run``'s arguments, given as to ``run`` (an unknown keyword is a TypeError), checked."""
    bound = inspect.signature(run).bind(*args, **kwargs)
    bound.apply_defaults()
    return config.check_arguments(**bound.arguments)


def attempts(cfg: config.RunConfig, view: views.ClusterView, profile, spec, policy: core.Policy, sizer: Sizer) -> Any:
    """The pipeline's last step, ``run``'s and ``run_elastic``'s: the run's display, then its
    attempts, each a job of the view's with the stage's input for its size."""
    a = cfg.args
    # A fixed run's stage input is built before anything launches; an elastic one's for each size it takes.
    spec = dataclasses.replace(spec, user_env={**spec.user_env, **resume.env(cfg)})
    frames = a.frames
    if frames:  # the DataFrames the ranks read from their files leave the stage
        from .launch.scans import file_scans

        scans = file_scans(frames, spec.size, a.storage_options)
        frames = {n: df for n, df in frames.items() if n not in scans}
        spec = dataclasses.replace(spec, feed=tuple(frames), scans=tuple(scans.items()))
    known = policy.known_size
    sources: dict[int, Any] = {} if known is None else {known: _stage_input(frames, known)}
    info = RunInfo(run_id=a.run_id, fn_name=a.fn_name, stdout=a.stdout, stderr=a.stderr, timestamps=a.timestamps,
                   timeout=a.timeout, verbose=a.verbose)
    info.display.attach(log)

    def make_job(s, on_done):
        if s.size not in sources:
            sources[s.size] = _stage_input(frames, s.size)
        return view.job(s, a.fn_name, on_done, sources[s.size], profile)

    return run_attempts(info, spec, make_job, cfg.driver_host, policy, sizer)


def _stage_input(frames, size: int):
    """The barrier stage's input, carrying the fed DataFrames to the ranks; None without data."""
    if not frames:
        return None
    from .launch import feed

    return feed.stage_input(frames, size)
