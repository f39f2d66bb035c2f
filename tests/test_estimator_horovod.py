"""KerasEstimator with Horovod's parameters, on a real local[2] Spark and real TensorFlow ranks:
SparkBackend and Store.create as Horovod's, sparse and flat vectors reshaped to the model's input,
label_shapes, steps per epoch, the checkpoint callback's model as the trained one, the hints
that have no effect (one log line); and each bad value refused on the driver, naming the value
and the fix. Saving an estimator whose optimizer, loss and metrics are Keras objects loads back on
every Keras 3 release (Keras 3.2's optimizers do not pickle)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import sparktrain
from conftest import module_spark

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[2]")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


def _digits(spark, directory, n=400):
    """Digits as Horovod's examples read them: libsvm's sparse 64-long ``features`` Vector, and the
    label one-hot encoded into ``label_vec``."""
    from pyspark.ml.feature import OneHotEncoder
    from sklearn.datasets import dump_svmlight_file, load_digits

    x, y = load_digits(return_X_y=True)
    path = os.path.join(directory, f"digits-{n}.libsvm")
    dump_svmlight_file(x[:n] / 16.0, y[:n], path, zero_based=False)
    df = spark.read.format("libsvm").option("numFeatures", "64").load(path)
    return OneHotEncoder(inputCols=["label"], outputCols=["label_vec"], dropLast=False).fit(df).transform(df)


def _convnet():
    import keras

    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])


def _recorder(outdir):
    import keras

    class Recorder(keras.callbacks.Callback):
        """Notes each rank's batches per epoch, its environment and temp dir; marks epoch 1 the best."""

        def on_epoch_begin(self, epoch, logs=None):
            self.train, self.val = 0, 0

        def on_train_batch_end(self, batch, logs=None):
            self.train += 1

        def on_test_batch_end(self, batch, logs=None):
            self.val += 1

        def on_epoch_end(self, epoch, logs=None):
            import tempfile

            logs["marker"] = 0.0 if epoch == 0 else 1.0  # the checkpoint callback keeps the lowest: epoch 1
            with open(os.path.join(outdir, f"rank-{sparktrain.rank()}-epoch-{epoch}.json"), "w") as f:
                json.dump({"train": self.train, "val": self.val, "mark": os.environ.get("HVD_MARK"),
                           "tmp": tempfile.gettempdir()}, f)

    return Recorder()


def _weights(path):
    import keras

    return [w.tolist() for w in keras.saving.load_model(path, compile=False).get_weights()]


def test_a_horovod_style_fit_honours_backend_store_steps_and_the_checkpoint_callback(spark, tmp_path, caplog):
    import keras

    from sparktrain.keras.callbacks import BestModelCheckpoint
    from sparktrain.ml import KerasEstimator, SparkBackend, Store

    df = _digits(spark, str(tmp_path))
    outdir, staging = tmp_path / "record", tmp_path / "staging"
    outdir.mkdir()
    staging.mkdir()
    store = Store.create(str(tmp_path / "store"), temp_dir=str(staging))
    backend = SparkBackend(num_proc=2, env={"HVD_MARK": "from-backend", **ENV})
    est = KerasEstimator(
        backend=backend, store=store, model=_convnet(), optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.CategoricalCrossentropy(), metrics=[keras.metrics.CategoricalAccuracy()],
        feature_cols=["features"], label_cols=["label_vec"], validation=0.25, batch_size=16, epochs=2,
        train_steps_per_epoch=3, validation_steps_per_epoch=2, random_seed=3, verbose=0,
        callbacks=[_recorder(str(outdir))], inmemory_cache_all=True, reader_pool_type="process",
        checkpoint_callback=BestModelCheckpoint(monitor="marker", mode="min"))  # Horovod's, without filepath
    with caplog.at_level("WARNING", logger="sparktrain"):
        model = est.fit(df)
    # Every rank ran exactly the steps asked for, each epoch, with the backend's environment and the store's temp dir.
    records = {name: json.loads((outdir / name).read_text()) for name in os.listdir(outdir)}
    assert sorted(records) == [f"rank-{r}-epoch-{e}.json" for r in range(2) for e in range(2)]
    assert {(v["train"], v["val"], v["mark"], v["tmp"]) for v in records.values()} == {
        (3, 2, "from-backend", str(staging))}
    hints = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(hints) == 1 and "inmemory_cache_all=True" in hints[0] and "reader_pool_type='process'" in hints[0]
    # Horovod's layout of the store: <prefix>/runs/<run_id>/; the trained model is the one the callback kept.
    run = tmp_path / "store" / "runs" / model.getRunId()
    assert model.getModelUrl() == f"file://{run}/model.keras"
    trained = _weights(str(run / "model.keras"))
    assert trained == _weights(str(run / "checkpoints" / "epoch-0001.keras"))
    assert trained != _weights(str(run / "checkpoints" / "epoch-0002.keras"))
    assert len(model.getHistory()["loss"]) == 2
    # Scoring reshapes the sparse 64-long vectors to the model's (8, 8, 1) input as training did.
    scored = model.transform(df.limit(20)).select("label_vec__output").collect()
    assert len(scored) == 20 and all(len(r[0]) == 10 for r in scored)
    assert not os.listdir(staging)


def _pairs_loss(y_true, y_pred):
    """A loss that takes its labels as (batch, 2, 2): with (batch, 4) labels the shapes do not broadcast."""
    import keras

    return keras.ops.mean(keras.ops.square(keras.ops.reshape(y_pred, (-1, 2, 2)) - y_true))


def _pairs_gap(y_true, y_pred):
    """A metric as Keras 2 code wrote them: TensorFlow's own ops, which take both sides in one dtype
    (tf_keras cast the labels to the prediction's; Keras 3 hands them over as they come)."""
    import tensorflow as tf

    return tf.reduce_mean(tf.abs(tf.reshape(y_pred, (-1, 2, 2)) - y_true))


def test_label_shapes_reshape_the_labels_and_stacked_columns_feed_a_shaped_input(spark, tmp_path):
    import keras
    from pyspark.sql import functions as F

    from sparktrain.ml import KerasEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    df = spark.createDataFrame([(*map(float, row),) for row in x], [f"c{i}" for i in range(4)])
    df = df.withColumn("target", F.array(*[F.col(f"c{i}") * 2 for i in range(4)]))
    model = keras.Sequential([keras.Input((2, 2)), keras.layers.Flatten(), keras.layers.Dense(4)])
    # A Keras ModelCheckpoint that keeps weights only: the trained model has the best epoch's weights.
    keep = keras.callbacks.ModelCheckpoint("w.weights.h5", monitor="loss", save_best_only=True, save_weights_only=True)
    # The double columns reach the float32 model as float32: the label (array<double>) too, so _pairs_gap works.
    est = KerasEstimator(model=model, optimizer=keras.optimizers.Adam(1e-2), loss=_pairs_loss, metrics=[_pairs_gap],
                         feature_cols=[f"c{i}" for i in range(4)], label_cols=["target"], label_shapes=[(2, 2)],
                         batch_size=8, epochs=3, num_proc=2, store=f"file://{tmp_path}/store", verbose=0, env=ENV,
                         checkpoint_callback=keep)
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0], history
    assert len(history["_pairs_gap"]) == 3 and history["_pairs_gap"][-1] < history["_pairs_gap"][0], history
    best = int(np.argmin(history["loss"])) + 1
    run = tmp_path / "store" / fitted.getRunId()
    assert _weights(str(run / "model.keras")) == _weights(str(run / "checkpoints" / f"epoch-{best:04d}.keras"))


def _jobs_started(spark) -> int:
    return int(spark.sparkContext._jsc.sc().dagScheduler().nextJobId())


def _bad_cases(tmp_path):
    import keras

    from sparktrain.ml import SparkBackend

    def model(shape, out=10):
        return keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(out)])

    ok = dict(optimizer=keras.optimizers.Adam(1e-3), loss="categorical_crossentropy", feature_cols=["features"],
              label_cols=["label_vec"], store=f"file://{tmp_path}/never-written", model=model((8, 8, 1)))
    return [
        ("features vs input", dict(ok, model=model((28, 28, 1))), sparktrain.InvalidArgumentError,
         ["'features'", "64 value(s)", "(28, 28, 1)", "784", "keras.Input(shape=(64,))"]),
        ("label vs output", dict(ok, model=model((64,), out=3)), sparktrain.InvalidArgumentError,
         ["'label_vec'", "10 value(s)", "(3,)", "OneHotEncoder(dropLast=False)", "label_shapes=[(10,)]"]),
        ("label_shapes size", dict(ok, label_shapes=[(3, 3)]), sparktrain.InvalidArgumentError,
         ["label_shapes", "(3, 3)", "9 value(s)", "holds 10"]),
        ("label_shapes form", dict(ok, label_shapes="10"), sparktrain.InvalidArgumentError,
         ["label_shapes='10'", "label_shapes=[(10,)]"]),
        ("backend kind", dict(ok, backend="spark"), sparktrain.InvalidArgumentError,
         ["sparktrain.ml.SparkBackend", "builtins.str"]),
        ("backend and num_proc", dict(ok, backend=SparkBackend(num_proc=2), num_proc=2), sparktrain.InvalidArgumentError,
         ["num_proc=2", "SparkBackend"]),
        ("steps", dict(ok, train_steps_per_epoch=0), sparktrain.InvalidArgumentError, ["train_steps_per_epoch=0"]),
        ("val steps", dict(ok, validation_steps_per_epoch=4), sparktrain.InvalidArgumentError,
         ["validation_steps_per_epoch=4", "validation=0.1"]),
        ("checkpoint callback", dict(ok, checkpoint_callback=keras.callbacks.EarlyStopping()),
         sparktrain.InvalidArgumentError, ["checkpoint_callback", "ModelCheckpoint", "EarlyStopping"]),
        ("start method", dict(ok, mp_start_method="thread"), sparktrain.InvalidArgumentError,
         ["mp_start_method='thread'", "spawn"]),
        ("store kind", dict(ok, store=42), sparktrain.InvalidArgumentError, ["store=42", "Store.create"]),
    ]


def test_bad_horovod_parameters_are_refused_before_any_spark_job(spark, tmp_path):
    from sparktrain.ml import KerasEstimator

    # The feature stages wrote the Vectors' lengths into the schema: no job looks at a row.
    df = _digits(spark, str(tmp_path), n=20)
    for case, params, error, words in _bad_cases(tmp_path):
        before = _jobs_started(spark)
        with pytest.raises(error) as e:
            KerasEstimator(**params).fit(df)
        assert _jobs_started(spark) == before, case
        for word in words:
            assert word in str(e.value), (case, str(e.value))
    assert not os.path.exists(tmp_path / "never-written")


def test_a_vector_length_the_schema_does_not_hold_is_read_from_one_row(spark, tmp_path):
    import keras
    from pyspark.ml.linalg import Vectors

    from sparktrain.ml import KerasEstimator

    df = spark.createDataFrame([(Vectors.dense([0.0] * 5), 1.0)] * 4, ["features", "label"])
    est = KerasEstimator(model=keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]), optimizer="adam",
                         loss="mse", feature_cols=["features"], label_cols=["label"], num_proc=2,
                         store=f"file://{tmp_path}/never-written")
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"'features' holds 5 value\(s\) per row.*\(8,\)"):
        est.fit(df)


@pytest.mark.parametrize("name, error, words", [
    ("transformation_fn", sparktrain.UnsupportedError, ["transformation_fn", "mapInPandas"]),
    ("transformation_edit_fields", sparktrain.UnsupportedError, ["transformation_edit_fields", "Spark"]),
    ("no_such_param", sparktrain.InvalidArgumentError, ["'no_such_param'", "its parameters"]),
])
def test_what_cannot_be_honoured_is_refused_at_construction(name, error, words):
    from sparktrain.ml import KerasEstimator

    with pytest.raises(error) as e:
        KerasEstimator(**{name: lambda row: row})
    for word in words:
        assert word in str(e.value)


def test_spark_backend_takes_horovods_keywords():
    from sparktrain.ml import SparkBackend

    out = open(os.devnull, "w")
    try:
        backend = SparkBackend(num_proc=3, env={"A": "1"}, stdout=out, stderr=out, prefix_output_with_timestamp=True,
                               start_timeout=30, nics="eth0", use_gloo=True, use_mpi=False)
        assert backend.num_processes() == 3
        assert backend.run_kwargs() == {"stdout": out, "stderr": out, "prefix_output_with_timestamp": True,
                                        "start_timeout": 30, "nics": "eth0"}
    finally:
        out.close()
    for kwargs, error, words in [
        ({"num_proc": 0}, sparktrain.InvalidArgumentError, ["num_proc=0", "positive"]),
        ({"env": {"A": 1}}, sparktrain.InvalidArgumentError, ["env={'A': 1}", "str to str"]),
        ({"use_mpi": True}, sparktrain.UnsupportedError, ["use_mpi=True", "no MPI"]),
        ({"extra_mpi_args": "-x FOO"}, sparktrain.UnsupportedError, ["extra_mpi_args='-x FOO'", "mpirun"]),
    ]:
        with pytest.raises(error) as e:
            SparkBackend(**kwargs)
        for word in words:
            assert word in str(e.value), (kwargs, str(e.value))


def test_store_create_takes_horovods_paths_and_keywords(tmp_path, monkeypatch, caplog):
    from sparktrain.ml import Store

    monkeypatch.chdir(tmp_path)
    assert Store.create("work").runs_url == f"file://{tmp_path}/work/runs"
    assert Store.create("file:///data/x", runs_path="file:///data/runs").get_run_path("r1") == "file:///data/runs/r1"
    assert Store.create("dbfs:/ml/digits").prefix_url == "file:///dbfs/ml/digits"
    abfs = Store.create("abfss://c@acct.dfs.core.windows.net/m", storage_options={"account_name": "acct"})
    assert abfs.runs_url == "abfss://c@acct.dfs.core.windows.net/m/runs" and abfs.storage_options == {"account_name": "acct"}
    assert abfs.without_credentials().storage_options == {} and abfs.storage_options
    assert Store.create("s3://bucket/m", checkpoint_filename="best").get_checkpoint_filename() == "best.keras"
    hdfs = Store.create("hdfs://namenode:8020/user/me/m", user="me", kerb_ticket="/tmp/krb5cc", driver="libhdfs")
    assert hdfs.storage_options == {"user": "me", "kerb_ticket": "/tmp/krb5cc"}
    with caplog.at_level("WARNING", logger="sparktrain"):
        Store.create("s3://bucket/m", train_path="s3://bucket/train", val_path="s3://bucket/val")
    assert [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()] == [
        "Store: train_path, val_path have no effect here: sparktrain writes no intermediate copy of the DataFrame "
        "(each rank's rows reach its executor's local disk through the run's barrier stage)"]
    for args, kwargs, error, words in [
        (("s3://b/m",), {"save_runs": False}, sparktrain.UnsupportedError, ["save_runs=False", "KerasModel"]),
        (("s3://b/m",), {"checkpoint_filename": "ckpt.h5"}, sparktrain.InvalidArgumentError, ["'ckpt.keras'"]),
        (("s3://b/m",), {"host": "nn"}, sparktrain.InvalidArgumentError, ["['host']", "hdfs://"]),
        (("hdfs:///m",), {"driver": "libhdfs3"}, sparktrain.UnsupportedError, ["driver='libhdfs3'", "libhdfs"]),
        (("s3://b/m",), {"bucket": "x"}, sparktrain.InvalidArgumentError, ["['bucket']", "storage_options"]),
        (("",), {}, sparktrain.InvalidArgumentError, ["Store.create('')", "fsspec URL"]),
    ]:
        with pytest.raises(error) as e:
            Store.create(*args, **kwargs)
        for word in words:
            assert word in str(e.value), (kwargs, str(e.value))


def test_an_estimator_with_keras_objects_saves_and_loads_back(spark, tmp_path):
    import keras

    from sparktrain.ml import KerasEstimator, SparkBackend, Store

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    est = KerasEstimator(
        model=_convnet(), optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
        loss={"dense": keras.losses.CategoricalCrossentropy(label_smoothing=0.1)},
        metrics=[keras.metrics.CategoricalAccuracy(), "mse"], feature_cols=["features"], label_cols=["label_vec"],
        backend=SparkBackend(num_proc=2, stdout=sys.stdout), label_shapes=[(10,)],
        store=Store.create("abfss://c@acct.dfs.core.windows.net/m", storage_options={"account_key": "secret-key"}),
        checkpoint_callback=keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True))
    path = str(tmp_path / "estimator")
    est.save(path)
    saved = b"".join(open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(path) for f in fs)
    assert b"secret-key" not in saved  # a Store's credentials are never saved
    loaded = KerasEstimator.load(path)
    optimizer = loaded.getOptimizer()
    assert type(optimizer) is keras.optimizers.SGD and optimizer.get_config()["momentum"] == 0.9
    assert optimizer.get_config()["learning_rate"] == est.getOptimizer().get_config()["learning_rate"]
    assert loaded.getLoss()["dense"].get_config()["label_smoothing"] == 0.1
    assert isinstance(loaded.getMetrics()[0], keras.metrics.CategoricalAccuracy) and loaded.getMetrics()[1] == "mse"
    config = [json.dumps(m.getModel().get_config(), sort_keys=True) for m in (loaded, est)]  # tuples come back lists
    assert config[0] == config[1]
    assert [w.tolist() for w in loaded.getModel().get_weights()] == [w.tolist() for w in est.getModel().get_weights()]
    assert loaded.getBackend().num_processes() == 2 and loaded.getBackend().stdout is None
    assert loaded.getStore().runs_url == est.getStore().runs_url and loaded.getStore().storage_options == {}
    assert loaded.getLabelShapes() == [(10,)] and loaded.getCheckpointCallback().save_best_only
