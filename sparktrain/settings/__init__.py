"""Settings that users may give as an argument, an environment variable or a Spark conf key.

They resolve in one order: argument > environment variable > Spark conf > default.
Pure: the Spark conf is passed in as a mapping-like getter.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Callable

from ..host import nics
from ..seam import worker_env
from .record import RankSettings, Settings, names as record_names
from .parsers import (choice as _choice, parse_bool, parse_bytes, parse_bytes_or_auto, parse_path, parse_gc_threshold, parse_legacy_keras, parse_positive_int,
                      parse_seconds, parse_seconds_or_off, parse_spin, url as _url)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    env: str
    #: The Spark conf key; None for settings read where there is no Spark conf (in a rank).
    conf: str | None
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str
    #: Where it is read: "driver", "rank" (the rank's process or task, from its environment) or "both".
    #: ``run`` resolves every one before launch; the rank-read ones reach the ranks in their env.
    read_in: str = "driver"


SETTINGS = {
    s.name: s
    for s in [
        Setting("start_timeout", "SPARKTRAIN_START_TIMEOUT", "spark.sparktrain.startTimeout", 600.0,
                parse_seconds, "seconds for every rank to start and check in"),
        Setting("grace_period", "SPARKTRAIN_GRACE_PERIOD", "spark.sparktrain.gracePeriod", 5.0,
                parse_seconds, "seconds between SIGTERM and SIGKILL when a rank's processes are stopped"),
        Setting("heartbeat_timeout", "SPARKTRAIN_HEARTBEAT_TIMEOUT", "spark.sparktrain.heartbeatTimeout", 8.0,
                parse_seconds, "seconds without a word on the channel (each end speaks every second) after which "
                "the driver fails the run naming the rank's host as unreachable, and a rank stops as cut off from "
                "the driver; 0 turns it off"),
        Setting("rendezvous", "SPARKTRAIN_RENDEZVOUS", "spark.sparktrain.rendezvous", "auto",
                lambda n, v: _choice(n, v, ("auto", "driver", "barrier")),
                "how ranks exchange addresses: 'driver' (through the driver's channel, milliseconds), "
                "'barrier' (one Spark allGather, when executors cannot reach the driver), 'auto'"),
        Setting("allow_unencrypted", "SPARKTRAIN_ALLOW_UNENCRYPTED", "spark.sparktrain.allowUnencrypted", False,
                parse_bool, "run with encryption off although Spark's encryption is on (spark.network.crypto.enabled, "
                "spark.ssl.enabled or spark.io.encryption.enabled), or with training traffic that sparktrain does "
                "not encrypt (TensorFlow's ring, cpu_collectives='tensorflow')"),
        Setting("encryption", "SPARKTRAIN_ENCRYPTION", "spark.sparktrain.encryption", "auto",
                lambda n, v: _choice(n, v, ("auto", "on", "off")),
                "AES-256-GCM on the driver's channel and on the native engine's ring between hosts, with keys "
                "derived from the run's secret (docs/security.md): 'auto' (on when any of spark.network.crypto."
                "enabled, spark.ssl.enabled or spark.io.encryption.enabled is true), 'on' or 'off'",
                read_in="both"),
        Setting("max_attempts", "SPARKTRAIN_MAX_ATTEMPTS", "spark.sparktrain.maxAttempts", 1,
                parse_positive_int, "how many times a failed run is started again, whole gang, before it fails"),
        Setting("spill_url", "SPARKTRAIN_SPILL_URL", "spark.sparktrain.spillUrl", None,
                lambda n, v: _url(n, v),
                "fsspec URL (a prefix) where rank 0 spills a return value too large for spark.driver.maxResultSize; "
                "the driver reads it back and deletes it. Default: a local temporary directory on local masters, "
                "none elsewhere; 'none' turns it off"),
        Setting("log_url", "SPARKTRAIN_LOG_URL", "spark.sparktrain.logUrl", None, lambda n, v: _url(n, v),
                "fsspec URL (a prefix) where ranks also write their output; the driver prints it from there "
                "when the ranks cannot reach it (Spark Connect); 'none' turns it off"),
        Setting("elastic_url", "SPARKTRAIN_ELASTIC_URL", "spark.sparktrain.elasticUrl", None, lambda n, v: _url(n, v),
                "fsspec URL (a prefix) where elastic state.commit() writes the training state, under the run's id "
                "(run_id=, when given), so that a later attempt of the run (max_attempts), or a later job with the "
                "same run_id, resumes from it; 'none' turns it off",
                read_in="both"),
        Setting("lease_timeout", "SPARKTRAIN_LEASE_TIMEOUT", "spark.sparktrain.leaseTimeout", 60.0, parse_seconds,
                "a named run (run_id=): seconds after its driver's last renewal at which the run's lease in its "
                "home expires, so that a later job may take the run over; the driver renews it every third of "
                "this while the run lives. A live lease refuses a second driver at once"),
        Setting("elastic_grow_after", "SPARKTRAIN_ELASTIC_GROW_AFTER", "spark.sparktrain.elasticGrowAfter", 60.0,
                parse_seconds, "run_elastic: seconds that free slots for more ranks must last before the running "
                "attempt ends at its next commit and the next one starts larger"),
        Setting("stall_warning", "SPARKTRAIN_STALL_WARNING", "spark.sparktrain.stallWarning", 60.0,
                parse_seconds_or_off, "seconds a collective waits for ranks that have not arrived before the driver "
                "prints a stall report: which ranks wait in which collective, which have not arrived, and their "
                "Python stacks; the same report goes into the error of a run that then fails; 0 turns it off"),
        Setting("nics", "SPARKTRAIN_NICS", "spark.sparktrain.nics", None, nics.parse,
                "the network ranks use for the driver's channel and their ring, as Horovod's nics: interface "
                "names or subnets, comma-separated ('eth1' or '10.1.0.0/16'); each host uses its first address "
                "that matches. None: the addresses Spark knows the driver and the executors by"),
        Setting("capacity_wait", "SPARKTRAIN_CAPACITY_WAIT", "spark.sparktrain.capacityWait", 10.0,
                parse_seconds, "seconds to wait for executors to register before the slot check fails"),
        # Read in the rank's process; no Spark conf key: give it with run(env=...) or the driver's environment.
        Setting("collective_timeout", "SPARKTRAIN_COLLECTIVE_TIMEOUT", None, 600.0, parse_seconds,
                "seconds a collective waits for the other ranks before it fails (sparktrain.tensorflow.init)",
                read_in="rank"),
        Setting("cpu_collectives", "SPARKTRAIN_CPU_COLLECTIVES", "spark.sparktrain.cpuCollectives", "native",
                lambda n, v: _choice(n, v, ("native", "tensorflow")),
                "the engine of collectives on CPU: 'native' (sparktrain's shared memory and TCP ring, where it "
                "was built) or 'tensorflow' (TensorFlow's gRPC ring)",
                read_in="rank"),
        Setting("cpu_transport", "SPARKTRAIN_CPU_TRANSPORT", "spark.sparktrain.cpuTransport", "auto",
                lambda n, v: _choice(n, v, ("auto", "tcp")),
                "how the native engine connects ranks on one host: 'auto' (shared memory) or 'tcp' (the ring "
                "between hosts, forced; for tests and measurements)",
                read_in="rank"),
        Setting("spin_wait", "SPARKTRAIN_SPIN_WAIT", "spark.sparktrain.spinWait", "auto", parse_spin,
                "seconds a native collective waiting for a rank on its host spins before it sleeps: 'auto' "
                "(2 ms where the host's ranks do not outnumber its cores, else 0) or a number from 0 to 1",
                read_in="rank"),
        Setting("tf_kernels", "SPARKTRAIN_TF_KERNELS", "spark.sparktrain.tfKernels", True, parse_bool,
                "run the native engine's collectives as TensorFlow kernels (compiled with g++ at first use and "
                "cached); false: through tf.numpy_function, as where no compiler is found",
                read_in="rank"),
        Setting("warm_rank_process", "SPARKTRAIN_WARM_RANK_PROCESS", "spark.sparktrain.warmRankProcess", False,
                parse_bool, "retired: accepted, and does nothing but warn once; every rank process starts "
                "with its run, held while the ranks meet"),
        Setting("backend", "KERAS_BACKEND", "spark.sparktrain.backend", None,
                lambda n, v: _choice(n, v, ("tensorflow", "jax", "torch", "numpy", "openvino")),
                "the Keras backend of every rank (run's backend argument, else the driver's KERAS_BACKEND or the "
                "one run's env gives): 'jax' also hands each rank what keras.distribution.initialize() and "
                "sparktrain.jax.initialize() read (docs/jax.md); None leaves the ranks' KERAS_BACKEND as it is"),
        Setting("legacy_keras", "TF_USE_LEGACY_KERAS", "spark.sparktrain.legacyKeras", None, parse_legacy_keras,
                "whether tf.keras is tf_keras (Keras 2) in every rank: true writes TF_USE_LEGACY_KERAS=1 into the "
                "ranks' environment, false 0; from the driver's TF_USE_LEGACY_KERAS, run's env or the conf. None "
                "leaves the ranks' own (docs/from-horovod.md, Keras 2 code). Read as TensorFlow reads it: 1, true "
                "or True, else 0, false, False or empty; any other value (yes, on, TRUE) is refused before launch, "
                "since TensorFlow would give this driver Keras 3",
                read_in="both"),
        Setting("jax_cpu_devices", "JAX_NUM_CPU_DEVICES", "spark.sparktrain.jaxCpuDevices", 1, parse_positive_int,
                "on a JAX run, how many devices JAX's CPU platform shows in each rank that has no GPU (a mesh of "
                "ranks x devices for keras.distribution)"),
        Setting("pin_cores", "SPARKTRAIN_PIN_CORES", "spark.sparktrain.pinCores", "auto",
                lambda n, v: _choice(n, v, ("auto", "on", "off")),
                "keep each rank on cores of its own, the host's cores split among its ranks: 'auto' (where the "
                "ranks own the machine: local mode and local masters, and only when ranks do not outnumber "
                "cores), 'on' (on clusters too) or 'off'",
                read_in="rank"),
        Setting("data_cache_limit", "SPARKTRAIN_DATA_CACHE_LIMIT", "spark.sparktrain.dataCacheLimit", "auto",
                parse_bytes_or_auto,
                "bytes of local disk each rank may keep of a DataFrame it reads from its files (run's data= of a "
                "Parquet scan), so that later epochs read it from there; what does not fit is read from the "
                "files again each epoch. 'auto': half the free space of the executor's local directory, shared "
                "among the host's ranks; 0 keeps nothing",
                read_in="rank"),
        Setting("bucket_bytes", "SPARKTRAIN_BUCKET_BYTES", "spark.sparktrain.bucketBytes", 4 << 20, parse_bytes,
                "bytes of gradients in one bucket of a compiled step (DistributedOptimizer, DistributedGradientTape "
                "inside tf.function; DistributedOptimizer in a jitted step of Keras 3 on JAX, on CPU: docs/jax.md): "
                "buckets are filled in reverse order of the variables, as backprop makes them, and each is reduced "
                "on the engine's thread as soon as its gradients exist, while backprop goes on (docs/performance.md); "
                "0: one collective per dtype once every gradient exists",
                read_in="rank"),
        Setting("timeline", "SPARKTRAIN_TIMELINE", "spark.sparktrain.timeline", None, parse_path,
                "a file each rank writes a Chrome trace of its collectives to, from init() until shutdown() or its "
                "exit (as start_timeline: rank r > 0 writes it with .rank<r> before the extension; gradient "
                "buckets on a lane of their own, beside the moments backprop made them); None: no timeline",
                read_in="rank"),
        Setting("gc_threshold", worker_env.GC_THRESHOLD, "spark.sparktrain.gcThreshold",
                worker_env.GC_THRESHOLD_DEFAULT, parse_gc_threshold,
                "the rank process's gc.set_threshold, set before it loads train_fn: the default lets the "
                "oldest generation wait for 100 collections of the one below it (Python's own: 10), so that "
                "the half a million objects TensorFlow and Keras make as they import are not traversed again "
                "and again while they load; 'python' keeps Python's own thresholds",
                read_in="rank"),
    ]
}


#: Spark's own encryption settings: with any of them true, ``encryption='auto'`` is on.
SPARK_ENCRYPTION = ("spark.network.crypto.enabled", "spark.ssl.enabled", "spark.io.encryption.enabled")


def spark_encryption(conf: Mapping[str, str]) -> list[str]:
    """Which of Spark's encryption settings are on in ``conf``.

    >>> spark_encryption({"spark.ssl.enabled": "true", "spark.io.encryption.enabled": "false"})
    ['spark.ssl.enabled']
    """
    return [k for k in SPARK_ENCRYPTION if str(conf.get(k, "false")).strip().lower() == "true"]


def encrypts(value: str, conf: Mapping[str, str] | None) -> bool:
    """Whether a run encrypts its channel and ring, given the resolved ``encryption`` setting:
    'auto' follows Spark's own encryption in ``conf``.

    >>> encrypts("auto", {"spark.network.crypto.enabled": "true"}), encrypts("auto", {}), encrypts("on", {})
    (True, False, True)
    """
    return value == "on" or (value == "auto" and bool(spark_encryption(conf or {})))


#: Settings the ranks read from their environment (the table's ``read_in``): ``run`` resolves them
#: on the driver, refusing a bad value before launch, and hands each rank the value it resolved
#: (``driver.launch.taskspec``); the rank parses them once, at its start (``sparktrain.settings.rank``).
READ_IN_RANK = tuple(name for name, s in SETTINGS.items() if s.read_in in ("rank", "both"))


def _check_records() -> None:
    """The typed records hold the table's settings, each by its name: a setting added to the table
    without its field, a field the table lacks, or a misspelt one fails here, at import."""
    for record, want in ((Settings, set(SETTINGS)), (RankSettings, set(READ_IN_RANK))):
        have = set(record_names(record))
        if have != want:
            raise TypeError(f"sparktrain.settings.{record.__name__} must hold exactly the table's settings "
                            f"(settings/record.py): missing {sorted(want - have)}, unknown {sorted(have - want)}")



def resolve(name: str, argument: Any = None, *, conf: Mapping[str, str] | None = None,
            environ: Mapping[str, str] | None = None) -> Any:
    """Resolve one setting: argument > environment variable > Spark conf > default.

    >>> resolve("grace_period", None, conf={"spark.sparktrain.gracePeriod": "2"}, environ={})
    2.0
    """
    s = SETTINGS[name]
    environ = os.environ if environ is None else environ
    if argument is not None:
        return s.parse(name, argument)
    if environ.get(s.env) not in (None, ""):
        return s.parse(s.env, environ[s.env])
    if conf is not None and s.conf is not None and conf.get(s.conf) not in (None, ""):
        return s.parse(s.conf, conf.get(s.conf))
    return s.default


def parse_value(name: str, value: Any) -> Any:
    """One setting's value as given by argument, parsed as the table parses it (named in errors)."""
    return SETTINGS[name].parse(name, value)


def check_environ(environ: Mapping[str, str]) -> None:
    """Parse every setting that ``environ`` gives, so that a bad one fails now, naming the variable."""
    for s in SETTINGS.values():
        if environ.get(s.env) not in (None, ""):
            s.parse(s.env, environ[s.env])


def resolve_all(arguments: Mapping[str, Any] | None = None, *, conf: Mapping[str, str] | None,
                environ: Mapping[str, str], record: type[RankSettings] = Settings) -> RankSettings:
    """Every setting of ``record`` (default: the table's every one), each by :func:`resolve`'s
    order, into that typed frozen record; a bad value raises naming where it came from.

    >>> v = resolve_all({"grace_period": 2}, conf={"spark.sparktrain.rendezvous": "driver"}, environ={})
    >>> v.grace_period, v.rendezvous, v.origin("rendezvous"), v.origin("start_timeout")
    (2.0, 'driver', 'conf', 'default')
    """
    arguments, held = arguments or {}, set(record_names(record))
    values, origins = {}, {}
    for name in (name for name in SETTINGS if name in held):  # the table's order: its first bad value raises
        s, given = SETTINGS[name], arguments.get(name)
        values[name] = resolve(name, given, conf=conf, environ=environ)
        origins[name] = ("argument" if given is not None else
                         "environment" if environ.get(s.env) not in (None, "") else
                         "conf" if conf is not None and s.conf is not None and conf.get(s.conf) not in (None, "")
                         else "default")
    return record(**values, origins=origins)


_check_records()


def as_text(value: Any) -> str:
    """A parsed value written back as its environment variable takes it.

    >>> as_text(True), as_text(30.0), as_text(""), as_text("tcp")
    ('1', '30.0', 'none', 'tcp')
    """
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == "":
        return "none"  # a URL setting turned off
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


#: Settings that are still accepted but no longer do anything (each warns once per process when set).
RETIRED = ("warm_rank_process",)
_warned: set[str] = set()


def warn_retired(conf: Mapping[str, str] | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn once per process for each retired setting that is set; returns what it warned about.

    >>> warn_retired({"spark.sparktrain.warmRankProcess": "false"}, environ={})  # doctest: +SKIP
    ['spark.sparktrain.warmRankProcess']
    """
    environ = os.environ if environ is None else environ
    said = []
    for name in RETIRED:
        s = SETTINGS[name]
        found = [k for k, where in ((s.env, environ), (s.conf, conf or {})) if where.get(k) not in (None, "")]
        for key in found:
            if key not in _warned:
                _warned.add(key)
                said.append(key)
                import warnings

                warnings.warn(f"sparktrain: {key} no longer does anything ({s.doc}); remove it from your "
                              "configuration", FutureWarning, stacklevel=3)
    return said
