"""MLflowLogger on 2 JAX ranks of a local[2] Spark, against a real ``mlflow server``
(tests/mlflow_server.py): rank 0 alone logs into the driver's run, and the model it logs pins
JAX, not TensorFlow. A module of its own, so that the JAX tier's two test processes share the
work: test_jax.py in one, this and notebooks/06-jax.ipynb in the other."""
from __future__ import annotations


import numpy as np
import pytest

import sparktrain
from conftest import module_spark
from helpers import digits_mlp, skip_without_jax
from mlflow_server import mlflow_server  # noqa: F401 - the fixture

skip_without_jax()
pytestmark = [pytest.mark.timeout(240), pytest.mark.jax]

spark = module_spark("local[2]")


def fit_with_mlflow(epochs: int):
    import keras

    import sparktrain.keras as hvd

    keras.utils.set_random_seed(1)
    hvd.init()
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    rng = np.random.default_rng(hvd.rank())  # each process feeds its own part of every global batch
    x, y = rng.random((64, 64), dtype=np.float32), rng.integers(0, 10, 64)
    model = digits_mlp()
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0,
              callbacks=[hvd.callbacks.MLflowLogger(batch_size=16, params={"dataset": "random"})])
    return hvd.rank()


def test_mlflow_logger_on_jax_ranks_logs_into_the_drivers_run_once_per_epoch_with_jax_pinned(
        spark, mlflow_server, monkeypatch, tmp_path):  # noqa: F811 - the fixture
    import uuid

    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.chdir(tmp_path)  # a stray local store would show up here
    experiment_id = mlflow.set_experiment(f"sparktrain-jax-{uuid.uuid4().hex[:8]}").experiment_id
    try:
        with mlflow.start_run() as run:
            sparktrain.run(fit_with_mlflow, args=(3,), num_proc=2, backend="jax", verbose=0, timeout=200)
    finally:
        mlflow.set_experiment("Default")
    client = mlflow.MlflowClient(mlflow_server.uri)
    runs = client.search_runs([experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # rank 1 started none of its own
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2]  # rank 0 alone
    params = runs[0].data.params
    assert {k: params.get(k) for k in ("num_proc", "batch_size", "global_batch_size", "epochs", "dataset")} == {
        "num_proc": "2", "batch_size": "16", "global_batch_size": "32", "epochs": "3", "dataset": "random"}
    models = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list",
                                         filter_string=f"source_run_id='{run.info.run_id}'")
    assert [m.name for m in models] == ["model"]
    requirements = open(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model/requirements.txt",
                                                            dst_path=str(tmp_path / "deps"))).read().split()
    pinned = {r.split("==")[0] for r in requirements if "==" in r}
    assert {"keras", "jax", "jaxlib", "numpy"} <= pinned and "tensorflow" not in pinned, requirements
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
