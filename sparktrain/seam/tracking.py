"""MLflow's hand-off from the driver to the ranks, and the redaction of its secrets. Pure: no side's imports.

On the driver, :func:`mlflow_handoff` collects what rank 0 needs to log into the driver's run:
the tracking URI, the run and experiment ids, and the credentials MLflow reads from the
environment. MLflow itself is asked only when the driver has already imported it (an active run,
a ``set_tracking_uri``); ``import sparktrain`` and a run without MLflow never load it.

On each rank, :func:`rank_env` turns the hand-off into environment variables: rank 0 gets all of
it, so plain ``mlflow.log_metric(...)`` resumes the driver's run; every other rank gets no run
id, no credentials, and a tracking URI that points into its own work directory, so a stray
logging call there creates a throwaway run that is deleted with the directory and never reaches
the tracking server. :func:`release_run` lets rank 0 exit without ending the driver's run.

Secrets (tokens, passwords, the password in a URI) never go into a log line or an error:
:func:`redacted` is what may be shown.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping

TRACKING_URI = "MLFLOW_TRACKING_URI"
RUN_ID = "MLFLOW_RUN_ID"
EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
#: Rank 0's copy of the handed-off run id: MLflow deletes ``MLFLOW_RUN_ID`` from the environment
#: once it resumed the run, and sparktrain still needs to know which run is the driver's.
HANDED_OFF_RUN = "SPARKTRAIN_MLFLOW_RUN_ID"
#: Set on rank 0 whenever the run uses MLflow, even when the user's ``env=`` brings every ``MLFLOW_*`` value.
IN_USE = "SPARKTRAIN_MLFLOW"

#: The variables that say where and as whom to log; each is forwarded from the driver to rank 0.
MLFLOW_VARS = (
    TRACKING_URI, RUN_ID, EXPERIMENT_ID, EXPERIMENT_NAME, "MLFLOW_REGISTRY_URI",
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_CLIENT_CERT_PATH", "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_WORKSPACE",
)
#: Databricks' credentials, which MLflow reads for the ``databricks`` tracking URI.
DATABRICKS_VARS = ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_CLIENT_ID", "DATABRICKS_CLIENT_SECRET")

#: What the ranks other than 0 must not inherit from the executor's own environment.
#: (An empty value reads as unset to MLflow, except for the experiment's name, which gets the
#: throwaway store's default experiment.)
_BLANKED = (RUN_ID, EXPERIMENT_ID, "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")

_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|PASSWD|CREDENTIAL|API_?KEY|ACCESS_?KEY|AUTH", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/@]*@")
_REDACTED = "<redacted>"


# -- what may be shown ------------------------------------------------------------------------------

def is_secret(name: str) -> bool:
    """Whether an environment variable's value must never be shown (tokens, passwords, keys)."""
    return bool(_SECRET_NAME.search(name))


def redact_uri(uri: str) -> str:
    """``uri`` with the password of its user info replaced.

    >>> redact_uri("https://me:hunter2@mlflow.example.com")
    'https://me:<redacted>@mlflow.example.com'
    """
    return _URI_PASSWORD.sub(lambda m: f"{m.group(1)}:{_REDACTED}@", uri)


def redacted(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as it may be logged: secret values replaced, passwords cut out of URIs.

    >>> redacted({"MLFLOW_TRACKING_TOKEN": "abc", "MLFLOW_TRACKING_URI": "http://h:5000"})
    {'MLFLOW_TRACKING_TOKEN': '<redacted>', 'MLFLOW_TRACKING_URI': 'http://h:5000'}
    """
    return {k: _REDACTED if is_secret(k) else redact_uri(str(v)) for k, v in env.items()}


# -- the driver's side ------------------------------------------------------------------------------

def _absolute_local_uri(uri: str, cwd: str) -> str:
    """A relative local store (``./mlruns``, ``sqlite:///mlflow.db``) made absolute: the ranks run elsewhere."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.join(cwd, uri[len("sqlite:///"):])
    if "://" not in uri and ":" not in uri.split("/", 1)[0] and not uri.startswith("databricks"):
        return "file://" + os.path.join(cwd, uri)  # a bare path
    return uri


def mlflow_handoff(environ: Mapping[str, str] | None = None, user_env: Mapping[str, str] | None = None,
                   cwd: str | None = None) -> dict[str, str]:
    """What rank 0 needs to log into the driver's MLflow run; empty when the driver uses no MLflow.

    Taken from the driver's environment (``MLFLOW_*``, and Databricks' credentials when MLflow is
    in use), then from MLflow itself when the driver imported it: the active run's id and
    experiment, and the tracking URI ``mlflow.set_tracking_uri`` chose. Variables the user passes
    in ``run(env=...)`` win and are left out here.
    """
    environ = os.environ if environ is None else environ
    user_env = user_env or {}
    cwd = cwd or os.getcwd()
    out = {k: environ[k] for k in MLFLOW_VARS if environ.get(k)}
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        try:
            run = mlflow.active_run()
            if run is not None or out or tracking_uri_set(mlflow):
                out[TRACKING_URI] = mlflow.get_tracking_uri()
            if run is not None:
                out[RUN_ID] = run.info.run_id
                out[EXPERIMENT_ID] = run.info.experiment_id
                out.pop(EXPERIMENT_NAME, None)  # the run decides the experiment
        except Exception:  # noqa: BLE001 - a half-configured MLflow must not stop training
            pass
    if not out and not any(k in user_env for k in MLFLOW_VARS):
        return {}
    out[IN_USE] = "1"
    out.update({k: environ[k] for k in DATABRICKS_VARS if environ.get(k)})
    if TRACKING_URI in out:
        out[TRACKING_URI] = _absolute_local_uri(out[TRACKING_URI], cwd)
    if RUN_ID in out:
        out[HANDED_OFF_RUN] = out[RUN_ID]
    return {k: v for k, v in out.items() if k not in user_env}


def tracking_uri_set(mlflow) -> bool:
    """Whether this process chose a tracking URI (``set_tracking_uri`` or ``MLFLOW_TRACKING_URI``)."""
    try:
        from mlflow.tracking._tracking_service import utils

        return bool(utils.is_tracking_uri_set())
    except Exception:  # noqa: BLE001 - a private helper; without it, trust the environment alone
        return False


def describe(handoff: Mapping[str, str]) -> str:
    """One line about a hand-off for the driver's log, with every secret redacted."""
    shown = redacted(handoff)
    parts = [f"run {shown[RUN_ID]}" if RUN_ID in shown else "a new run",
             f"at {shown.get(TRACKING_URI, 'the default tracking URI')}"]
    passed = sorted(k for k in shown if k not in (RUN_ID, TRACKING_URI, HANDED_OFF_RUN, IN_USE))
    if passed:
        parts.append("with " + ", ".join(f"{k}={shown[k]}" for k in passed))
    return " ".join(parts)


# -- the ranks' side --------------------------------------------------------------------------------

def rank_env(rank: int, handoff: Mapping[str, str] | None, workdir: str) -> dict[str, str]:
    """The MLflow variables of one rank's process (on top of its other env), given the driver's hand-off.

    >>> rank_env(0, {"MLFLOW_RUN_ID": "r1", "SPARKTRAIN_MLFLOW": "1"}, "/tmp/w")
    {'MLFLOW_RUN_ID': 'r1', 'SPARKTRAIN_MLFLOW': '1'}
    >>> rank_env(1, {"MLFLOW_RUN_ID": "r1"}, "/tmp/w")["MLFLOW_TRACKING_URI"]
    'sqlite:////tmp/w/mlflow-discarded.db'
    """
    if not handoff:
        return {}
    if rank == 0:
        return dict(handoff)
    env = {k: "" for k in _BLANKED}
    env[EXPERIMENT_NAME] = "Default"
    env[TRACKING_URI] = "sqlite:///" + os.path.join(os.path.abspath(workdir), "mlflow-discarded.db")
    env[HANDED_OFF_RUN] = ""
    env[IN_USE] = ""
    return env


def release_run() -> None:
    """Leave the driver's run as the driver left it when rank 0's process exits.

    MLflow ends every run its process started or resumed when the process exits, and marks it
    FINISHED; for the driver's run that is the driver's decision. Called after ``train_fn``
    returned; does nothing unless MLflow was imported and the driver's run is active here.
    """
    run_id = os.environ.get(HANDED_OFF_RUN)
    mlflow = sys.modules.get("mlflow")
    if not run_id or mlflow is None:
        return
    try:
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        stack[:] = [r for r in stack if r.info.run_id != run_id]
    except Exception:  # noqa: BLE001 - a private detail of MLflow; at worst the run shows FINISHED early
        pass
