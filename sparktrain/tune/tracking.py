"""A study in MLflow: with an active MLflow run on the driver, the study is that (parent) run and
each trial a nested run with its params, its reported values by step, and its state.

MLflow is asked only when the driver has imported it and a run is active. The nested runs are
made through ``MlflowClient`` (the trials run in Optuna's worker threads, where the driver's active
run is not active), and each trial's rank 0 logs into its own nested run (``env``).
"""
from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("sparktrain")

_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


class StudyRuns:
    """The nested runs of one study under the driver's active MLflow run."""

    def __init__(self, mlflow, parent):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        self._uri = mlflow.get_tracking_uri()
        self.parent_id = parent.info.run_id
        self.experiment_id = parent.info.experiment_id
        self._runs: dict[int, str] = {}

    @classmethod
    def active(cls) -> StudyRuns | None:
        """The study's runs, where the driver has an active MLflow run; else None."""
        mlflow = sys.modules.get("mlflow")
        if mlflow is None:
            return None
        parent = mlflow.active_run()
        return None if parent is None else cls(mlflow, parent)

    def start(self, number: int) -> dict[str, str]:
        """Open trial ``number``'s nested run; the environment its rank 0 logs into it with."""
        run = self._client.create_run(self.experiment_id, run_name=f"trial {number}",
                                      tags={"mlflow.parentRunId": self.parent_id, "optuna.trial": str(number)})
        self._runs[number] = run.info.run_id
        return {"MLFLOW_TRACKING_URI": self._uri, "MLFLOW_RUN_ID": run.info.run_id,
                "MLFLOW_EXPERIMENT_ID": self.experiment_id}

    def report(self, number: int, step: int, value: float) -> None:
        run_id = self._runs.get(number)
        if run_id is not None:
            self._client.log_metric(run_id, "intermediate_value", value, step=step)

    def end(self, number: int, state: str, params: dict[str, Any], value: Any) -> None:
        run_id = self._runs.pop(number, None)
        if run_id is None:
            return
        try:
            for k, v in params.items():
                self._client.log_param(run_id, k, v)
            if state == "COMPLETE":
                values = value if isinstance(value, (list, tuple)) else [value]
                for i, v in enumerate(values):
                    self._client.log_metric(run_id, "value" if len(values) == 1 else f"value_{i}", float(v))
            self._client.set_tag(run_id, "optuna.state", state)
        finally:
            self._client.set_terminated(run_id, _STATUS[state])
