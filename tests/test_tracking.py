"""Experiment tracking from the ranks: MLflow against a real ``mlflow server``, TensorBoard's event files on Azurite.

One Spark session (local[2]) for the module; 2 ranks, tiny models, 3 epochs.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import sys
import uuid

import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks, record_rank
from mlflow_server import mlflow_server  # noqa: F401 - the fixture
from sparktrain.seam import tracking
from sparktrain.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(300)

spark = module_spark("local[2]")

EPOCHS = 3
ENV = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
#: Stands for a real token: it must reach rank 0 and appear nowhere else.
TOKEN = "tok-" + uuid.uuid4().hex


@pytest.fixture(autouse=True)
def _no_mlflow_experiment_left_in_the_environment():
    """mlflow.set_experiment writes MLFLOW_EXPERIMENT_ID into os.environ, where a later module's
    run would take it for the driver's MLflow and hand it to rank 0: each test leaves it as found."""
    before = os.environ.get("MLFLOW_EXPERIMENT_ID")
    yield
    if before is None:
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    else:
        os.environ["MLFLOW_EXPERIMENT_ID"] = before


def _digest(value: str | None) -> str | None:
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()


# -- the hand-off itself, without Spark -------------------------------------------------------------

def test_handoff_from_the_environment_and_what_each_rank_gets(tmp_path, monkeypatch):
    # The hand-off from the environment alone: a driver that has not imported MLflow (an earlier test
    # of this process may have, and MLflow's own tracking URI would then win, as it should on a driver).
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)
    environ = {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db", "MLFLOW_RUN_ID": "r1", "MLFLOW_TRACKING_TOKEN": TOKEN,
               "DATABRICKS_TOKEN": TOKEN, "HOME": "/root"}
    handoff = tracking.mlflow_handoff(environ, {}, cwd="/work/here")
    assert handoff == {"MLFLOW_TRACKING_URI": "sqlite:////work/here/mlflow.db", "MLFLOW_RUN_ID": "r1",
                       "MLFLOW_TRACKING_TOKEN": TOKEN, "DATABRICKS_TOKEN": TOKEN,
                       tracking.HANDED_OFF_RUN: "r1", tracking.IN_USE: "1"}
    assert tracking.mlflow_handoff({"HOME": "/root", "DATABRICKS_TOKEN": TOKEN}, {}) == {}  # no MLflow: nothing
    # The user's own env= wins over the hand-off, and still counts as using MLflow.
    assert "MLFLOW_RUN_ID" not in tracking.mlflow_handoff(environ, {"MLFLOW_RUN_ID": "mine"})
    assert tracking.mlflow_handoff({}, {"MLFLOW_TRACKING_URI": "http://h"}) == {tracking.IN_USE: "1"}
    assert tracking.rank_env(0, handoff, str(tmp_path)) == handoff
    other = tracking.rank_env(1, handoff, str(tmp_path))
    assert other["MLFLOW_RUN_ID"] == other["MLFLOW_TRACKING_TOKEN"] == other[tracking.HANDED_OFF_RUN] == ""
    assert other["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow-discarded.db"
    assert tracking.rank_env(1, None, str(tmp_path)) == {}


def test_secrets_are_redacted_wherever_sparktrain_shows_them():
    handoff = {"MLFLOW_TRACKING_URI": f"https://me:{TOKEN}@mlflow.example.com", "MLFLOW_TRACKING_TOKEN": TOKEN,
               "MLFLOW_TRACKING_PASSWORD": TOKEN, "DATABRICKS_TOKEN": TOKEN, "MLFLOW_RUN_ID": "r1"}
    line = tracking.describe(handoff)
    assert TOKEN not in line and "MLFLOW_TRACKING_TOKEN=<redacted>" in line and "https://me:<redacted>@" in line
    from sparktrain.seam.spec import TaskSpec

    spec = TaskSpec(run_id="x", size=1, payload=b"", secret=b"", driver_address=None, use_gpu=False,
                    output_ranks=None, max_result_bytes=0, start_timeout=1.0, grace_period=1.0,
                    user_env={"MLFLOW_TRACKING_TOKEN": TOKEN}, mlflow=handoff)
    assert TOKEN not in repr(spec)
    with pytest.raises(InvalidArgumentError) as e:
        sparktrain.run(lambda: None, num_proc=-1, env={"MLFLOW_TRACKING_TOKEN": TOKEN.encode()})
    assert TOKEN not in str(e.value) and "MLFLOW_TRACKING_TOKEN" in str(e.value)


def test_mlflow_logger_warns_when_the_driver_set_up_no_tracking(monkeypatch, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from sparktrain.keras.tracking import MLflowLogger

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", tracking.IN_USE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARKTRAIN_RUN_ID", "r")  # inside a run whose driver used no MLflow
    monkeypatch.chdir(tmp_path)
    logger = MLflowLogger()
    try:
        with pytest.warns(RuntimeWarning, match="no tracking server from the driver"):
            logger._start()
        assert logger.run_id == mlflow.active_run().info.run_id
    finally:
        mlflow.end_run()
    assert (tmp_path / "mlflow.db").exists()


# -- MLflow against a real server --------------------------------------------------------------------

def fit_with_mlflow(outdir, token_digest, tensorboard_url, options):
    """A fit that logs to the driver's MLflow run and uploads TensorBoard's event files, as a user
    who wants both would write it."""
    import keras
    import mlflow
    import numpy as np

    import sparktrain.keras as hvd

    hvd.init()
    rank = hvd.rank()

    class RankValue(keras.callbacks.Callback):
        """Puts a metric that differs by rank into the logs: its average shows the ranks were averaged."""

        def on_epoch_end(self, epoch, logs=None):
            logs["rank_value"] = float(rank)

    seen = []

    class Probe(keras.callbacks.Callback):
        """After the upload of each epoch: what a reader finds on Azurite already, while training runs."""

        def on_epoch_end(self, epoch, logs=None):
            if rank == 0:
                seen.append(remote_scalars(tensorboard_url, options)[0])

    rng = np.random.default_rng(rank)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, validation_data=(x[:16], y[:16]),
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), RankValue(),
                         hvd.callbacks.MLflowLogger(batch_size=16, params={"dataset": "random"}),
                         hvd.callbacks.RemoteTensorBoard(tensorboard_url, storage_options=options), Probe()])
    stray_error = None
    if rank == 0:
        mlflow.log_metric("rank0_plain", 1.0)  # plain fluent call: the driver's run
    else:
        try:
            mlflow.log_metric("stray", 1.0)  # must not reach the server
        except Exception as e:  # noqa: BLE001
            stray_error = f"{type(e).__name__}: {e}"
    active = mlflow.active_run()
    record_rank(outdir, seen=seen, token_ok=_digest_env("MLFLOW_TRACKING_TOKEN") == token_digest,
                has_token=bool(os.environ.get("MLFLOW_TRACKING_TOKEN")), stray_error=stray_error,
                active_run=active.info.run_id if active else None, tracking_uri=mlflow.get_tracking_uri())


def _digest_env(name):
    return _digest(os.environ.get(name))


def stray_runs(client) -> list[str]:
    """Runs anywhere on the server that got rank 1's stray metric."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_id for r in client.search_runs(experiments, filter_string="metrics.stray > 0")]


def test_mlflow_run_on_the_driver_gets_params_averaged_metrics_and_the_model_and_tensorboard_files_every_epoch(
        spark, mlflow_server, azurite, monkeypatch, tmp_path, caplog):  # noqa: F811 - the fixture
    import mlflow

    from sparktrain import storage

    options = azurite.options()
    container = f"tb-{uuid.uuid4().hex[:10]}"
    storage.filesystem("abfs://x", options)[0].mkdir(container)
    url = f"abfs://{container}/runs/one"

    # Set after Spark started: the executors cannot have inherited them, only the hand-off brings them.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)  # the server has no auth and ignores it
    monkeypatch.chdir(tmp_path)  # a stray local store would show up here
    experiment = f"sparktrain-{uuid.uuid4().hex[:8]}"
    experiment_id = mlflow.set_experiment(experiment).experiment_id
    out = io.StringIO()
    caplog.set_level(logging.DEBUG, logger="sparktrain")
    try:
        with mlflow.start_run() as run:
            sparktrain.run(fit_with_mlflow, args=(str(tmp_path), _digest(TOKEN), url, options), num_proc=2,
                           env=ENV, verbose=2, stdout=out, stderr=out)
            # Rank 0 exited; the run is still the driver's, and still running.
            assert mlflow.MlflowClient().get_run(run.info.run_id).info.status == "RUNNING"
    finally:
        mlflow.set_experiment("Default")
    client = mlflow.MlflowClient(mlflow_server.uri)
    runs = client.search_runs([experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # exactly one run: rank 1's stray call made none
    assert runs[0].info.status == "FINISHED"
    for name in ("loss", "rank_value"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == list(range(EPOCHS)), name  # one point per epoch
    assert {m.value for m in client.get_metric_history(run.info.run_id, "rank_value")} == {0.5}  # averaged
    metrics = runs[0].data.metrics
    assert "rank0_plain" in metrics and "stray" not in metrics
    assert stray_runs(client) == []  # in no experiment either
    params = runs[0].data.params
    assert {k: params.get(k) for k in ("num_proc", "batch_size", "global_batch_size", "optimizer", "learning_rate",
                                       "epochs", "dataset")} == {
        "num_proc": "2", "batch_size": "16", "global_batch_size": "32", "optimizer": "Adam",
        "learning_rate": "0.009999999776482582", "epochs": "3", "dataset": "random"}
    models = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list",
                                         filter_string=f"source_run_id='{run.info.run_id}'")
    assert [m.name for m in models] == ["model"]
    # Downloaded under tmp_path: without dst_path, MLflow leaves a directory of its own behind.
    loaded = mlflow.keras.load_model(f"runs:/{run.info.run_id}/model", dst_path=str(tmp_path / "loaded"))
    # Its requirements: the rank's keras, tensorflow and numpy, pinned (not inferred in a process of MLflow's).
    import keras
    import numpy
    import tensorflow

    requirements = open(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model/requirements.txt",
                                                            dst_path=str(tmp_path / "deps"))).read().split()
    assert {f"keras=={keras.__version__}", f"tensorflow=={tensorflow.__version__}",
            f"numpy=={numpy.__version__}"} <= set(requirements), requirements
    assert loaded.predict(__import__("numpy").zeros((2, 4), "float32"), verbose=0).shape == (2, 1)

    ranks = read_ranks(str(tmp_path))
    assert ranks[0]["token_ok"] and ranks[0]["active_run"] == run.info.run_id
    assert not ranks[1]["has_token"] and ranks[1]["stray_error"] is None
    assert ranks[1]["active_run"] != run.info.run_id
    assert ranks[1]["tracking_uri"].startswith("sqlite:///") and "mlflow-discarded.db" in ranks[1]["tracking_uri"]
    assert not os.path.exists(ranks[1]["tracking_uri"][len("sqlite:///"):])  # gone with the rank's work directory
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    # The token went to rank 0 and was shown nowhere: not in the ranks' output, not in the driver's log.
    assert TOKEN not in out.getvalue()
    assert TOKEN not in caplog.text and "MLFLOW_TRACKING_TOKEN=<redacted>" in caplog.text

    # TensorBoard: rank 0's event files reached Azurite at each epoch's end, before the next began.
    assert ranks[0]["seen"] == [[0], [0, 1], [0, 1, 2]]
    assert ranks[1]["seen"] == []
    assert remote_scalars(url, options) == ([0, 1, 2], 1)  # one scalar per epoch, from rank 0 alone
    assert remote_scalars(url, options, "validation") == ([0, 1, 2], 1)


def test_a_keras_estimator_of_two_inputs_and_two_outputs_logs_into_the_drivers_run_and_scores(
        spark, mlflow_server, monkeypatch, tmp_path):  # noqa: F811 - the fixture
    """KerasEstimator.fit inside the driver's MLflow run, of a model with two inputs (one column
    each) and two outputs (one label each): its parameters, one point per epoch, the model,
    registered under registered_model_name; then transform fills one column per output."""
    import keras
    import mlflow
    import numpy as np

    from sparktrain.ml import KerasEstimator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    experiment_id = mlflow.set_experiment(f"sparktrain-est-{uuid.uuid4().hex[:8]}").experiment_id
    name = f"est-{uuid.uuid4().hex[:8]}"
    x = np.random.default_rng(0).normal(size=(256, 4))
    df = spark.createDataFrame([(x[i, :2].tolist(), float(x[i, 2]), float(x[i].sum() > 0), float(x[i].sum()))
                                for i in range(256)], "u array<double>, v double, positive double, total double")
    u, v = keras.Input((2,), name="u"), keras.Input((1,), name="v")
    both = keras.layers.Concatenate()([u, v])
    model = keras.Model([u, v], [keras.layers.Dense(1, activation="sigmoid", name="positive")(both),
                                 keras.layers.Dense(1, name="total")(both)])
    est = KerasEstimator(
        model=model, optimizer=keras.optimizers.Adam(0.01), loss={"positive": "binary_crossentropy", "total": "mse"},
        feature_cols=["u", "v"], label_cols=["positive", "total"], batch_size=16, epochs=EPOCHS, num_proc=2,
        store=f"file://{tmp_path}/store", registered_model_name=name, verbose=0, env=ENV)
    try:
        with mlflow.start_run() as run:
            fitted = est.fit(df)
    finally:
        mlflow.set_experiment("Default")
    client = mlflow.MlflowClient(mlflow_server.uri)
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run.info.run_id]
    # Every metric of the fit's history, one point per epoch: the per-output losses where this Keras
    # reports them (Keras 3.2 reports the total only).
    history = fitted.getHistory()
    assert "loss" in history and set(history) & {"positive_loss", "total_loss"} in (set(), {"positive_loss",
                                                                                          "total_loss"}), history
    for metric in history:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, metric)) == list(range(EPOCHS)), metric
    params = client.get_run(run.info.run_id).data.params
    assert (params.get("num_proc"), params.get("batch_size"), params.get("epochs")) == ("2", "16", str(EPOCHS))
    versions = client.search_model_versions(f"name='{name}'")
    assert [v.version for v in versions] == ["1"] and versions[0].run_id == run.info.run_id
    rows = fitted.transform(df.limit(10)).collect()
    assert len(rows) == 10 and all(isinstance(r["positive__output"], float) and isinstance(r["total__output"], float)
                                   and 0 <= r["positive__output"] <= 1 for r in rows)


def plain_logging(outdir):
    import mlflow

    if sparktrain.rank() == 0:
        mlflow.log_metric("from_rank0", 42.0)
    else:
        mlflow.log_metric("stray", 1.0)
    record_rank(outdir)


def failing_rank():
    raise ValueError("rank failed on purpose")


def test_run_id_from_the_environment_and_no_token_in_errors(spark, mlflow_server, monkeypatch, tmp_path):  # noqa: F811
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(f"sparktrain-env-{uuid.uuid4().hex[:8]}")
    run_id = client.create_run(experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    out = io.StringIO()
    # The tracking URI reaches every rank through env=; rank 1's stray call must still not reach the server.
    user_env = {**ENV, "MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_ID": experiment_id}
    sparktrain.run(plain_logging, args=(str(tmp_path),), num_proc=2, env=user_env, stdout=out, stderr=out)
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]
    assert stray_runs(client) == []
    got = client.get_run(run_id)
    assert got.data.metrics == {"from_rank0": 42.0}
    assert got.info.status == "RUNNING"  # rank 0 resumed it and left it as it was
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(failing_rank, num_proc=2, env=ENV, stdout=out, stderr=out)
    assert "rank failed on purpose" in str(e.value)
    assert TOKEN not in str(e.value) and TOKEN not in repr(e.value) and TOKEN not in out.getvalue()


# -- TensorBoard's event files on Azurite ------------------------------------------------------------

def remote_scalars(url, options, subdir="train", tag="epoch_loss") -> tuple[list[int], int]:
    """(steps of ``tag``, number of event files) under ``url/subdir``, read with TensorBoard's own reader."""
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sparktrain import storage

    fs, path = storage.filesystem(f"{url}/{subdir}", options)
    fs.invalidate_cache()
    files = [p for p in fs.find(path) if "tfevents" in p.rsplit("/", 1)[-1]]
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(files):
            fs.get_file(p, os.path.join(tmp, p.rsplit("/", 1)[-1]))
        acc = EventAccumulator(tmp, size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        tags = acc.Tags()
        if tag in tags.get("tensors", []):
            steps = [e.step for e in acc.Tensors(tag)]
        elif tag in tags.get("scalars", []):
            steps = [e.step for e in acc.Scalars(tag)]
        else:
            steps = []
    return sorted(steps), len(files)


def test_sync_dir_uploads_only_what_changed(tmp_path):
    from sparktrain import storage

    local = tmp_path / "logs"
    (local / "train").mkdir(parents=True)
    (local / "train" / "a").write_bytes(b"1")
    url = f"file://{tmp_path}/remote"
    state = storage.sync_dir(str(local), url)
    assert (tmp_path / "remote" / "train" / "a").read_bytes() == b"1"
    (tmp_path / "remote" / "train" / "a").write_bytes(b"changed remotely")  # not re-uploaded: unchanged locally
    (local / "b").write_bytes(b"2")
    state = storage.sync_dir(str(local), url, synced=state)
    assert (tmp_path / "remote" / "train" / "a").read_bytes() == b"changed remotely"
    assert (tmp_path / "remote" / "b").read_bytes() == b"2"
    with open(local / "train" / "a", "ab") as f:
        f.write(b"23")  # a log that grew
    storage.sync_dir(str(local), url, synced=state)
    assert (tmp_path / "remote" / "train" / "a").read_bytes() == b"123"
