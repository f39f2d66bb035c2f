"""The driver's public face: what ``sparktrain.tune``, ``sparktrain.ml``, the CLI and
``HorovodRunner`` use of the driver, and nothing under its stages (``launch``, ``supervise``,
``show``) besides. A run is ``supervise(prepare(arguments(...)), policy)``: ``run`` and
``run_elastic`` are that, with the policies ``Fixed`` and ``Elastic``; a client that needs the
cluster's facts before it runs (a study's slots, the settings a run would resolve) asks the same
``Launch`` the run is supervised on.

The session and cluster helpers below are the ones the CLI's report and ``sparktrain check`` read.
"""
from __future__ import annotations

from .launch.capacity import Capacity, check_capacity, check_gpu_conf, gpu_amount
from .launch.cluster import (active_session, expected_executors, is_local, start_session,
                             without_pyspark_warnings)
from .launch.config import Arguments, RunConfig, settings_of
from .launch.prepare import Launch, prepare
from .launch.preflight import check_cluster_conf
from .launch import probe
from .launch.views import ClusterView, choose as choose_view, of as view_of
from .run import arguments, run, run_elastic
from .show.display import sink_kind
from .show.spark_errors import spark_error_reason
from .supervise.attempts import supervise
from .supervise.interrupts import Cancellation
from .supervise.policies import Elastic, Fixed
from .supervise.ranklinks import RankLink

__all__ = [
    "Arguments", "Cancellation", "Capacity", "ClusterView", "Elastic", "Fixed", "Launch", "RankLink", "RunConfig",
    "active_session", "arguments", "check_capacity", "check_cluster_conf", "check_gpu_conf", "choose_view",
    "expected_executors", "gpu_amount", "is_local", "prepare", "probe", "run", "run_elastic", "settings_of",
    "sink_kind", "spark_error_reason", "start_session", "supervise", "view_of", "without_pyspark_warnings",
]
