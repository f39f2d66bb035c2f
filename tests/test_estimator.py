"""KerasEstimator and KerasModel on a real local[2] Spark, with the store on Azurite: a Pipeline that
trains on 2 ranks (through one failed attempt, resumed from the store), scores a held-out
DataFrame as well as one process trains, loads the model once per Python worker, and saves and
loads back; bad input is refused before any Spark job."""
from __future__ import annotations

import glob
import os
import uuid
import warnings

import numpy as np
import pytest

import sparktrain
from conftest import module_spark

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[2]")

EPOCHS, BATCH, LR, RANKS = 12, 16, 2e-3, 2
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    return (x[order] / 16.0).astype("float32"), y[order].astype("int32")


def _frame(spark, x, y):
    rows = [(int(i), *map(float, x[i]), int(y[i])) for i in range(len(y))]
    return spark.createDataFrame(rows, ["id", *[f"p{j}" for j in range(64)], "label"])


def _build(record_dir=None):
    import keras

    layers = [keras.Input((64,)), keras.layers.Dense(32, activation="relu")]
    if record_dir is not None:
        layers.append(LoadRecorder(record_dir))
    return keras.Sequential([*layers, keras.layers.Dense(10, activation="softmax")])


def _load_recorder():
    import keras

    class LoadRecorder(keras.layers.Layer):
        """An identity layer that notes the process that loads it from a saved model."""

        def __init__(self, record_dir, **kwargs):
            super().__init__(**kwargs)
            self.record_dir = record_dir

        def call(self, x):
            return x

        def get_config(self):
            return {**super().get_config(), "record_dir": self.record_dir}

        @classmethod
        def from_config(cls, config):
            with open(os.path.join(config["record_dir"], f"load-{os.getpid()}-{uuid.uuid4().hex}"), "w"):
                pass
            return cls(**config)

    return LoadRecorder


LoadRecorder = _load_recorder()


def _fail_once(outdir):
    import keras

    class FailOnce(keras.callbacks.Callback):
        """Rank 1 fails as the first attempt begins its third epoch (after every rank has seen the second
        epoch committed); each attempt notes the epoch it began with."""

        def on_epoch_begin(self, epoch, logs=None):
            path = os.path.join(outdir, f"attempt-{sparktrain.attempt()}-rank-{sparktrain.rank()}")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(str(epoch))
            if sparktrain.attempt() == 1 and epoch == 2:
                import tensorflow as tf

                import sparktrain.tensorflow as hvd

                hvd.allreduce(tf.constant(0.0))  # rank 0 is past its epoch-2 checkpoint
                if sparktrain.rank() == 1:
                    raise RuntimeError("rank 1 lost after epoch 2")

    return FailOnce()


@pytest.fixture(scope="module")
def fitted(spark, azurite, tmp_path_factory):
    import keras
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    from sparktrain import storage
    from sparktrain.ml import KerasEstimator

    x, y = _digits()
    train_df, test_df = _frame(spark, x[:1400], y[:1400]), _frame(spark, x[1400:], y[1400:])
    options = azurite.options()
    container = f"models-{uuid.uuid4().hex[:8]}"
    storage.filesystem("abfs://x", options)[0].mkdir(container)
    records = tmp_path_factory.mktemp("loads")
    outdir = tmp_path_factory.mktemp("attempts")
    keras.utils.set_random_seed(0)
    est = KerasEstimator(
        model=_build(str(records)), optimizer=keras.optimizers.Adam(LR), loss="sparse_categorical_crossentropy",
        metrics=["accuracy"], feature_cols=["features"], label_cols=["label"], validation=0.15, batch_size=BATCH,
        epochs=EPOCHS, num_proc=RANKS, random_seed=1, store=f"abfs://{container}/digits", storage_options=options,
        custom_objects={"LoadRecorder": LoadRecorder}, callbacks=[_fail_once(str(outdir))], max_attempts=2,
        verbose=0, env=ENV)
    assembler = VectorAssembler(inputCols=[f"p{j}" for j in range(64)], outputCol="features")
    pm = Pipeline(stages=[assembler, est]).fit(train_df)
    return {"pm": pm, "test_df": test_df, "x": x, "y": y, "options": options, "records": records,
            "outdir": outdir, "store": f"abfs://{container}/digits"}


def _accuracy(scored) -> float:
    rows = scored.select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))


def test_a_pipeline_trains_on_2_ranks_resumes_and_scores_as_well_as_one_process(fitted):
    import keras

    from sparktrain import storage

    pm, x, y = fitted["pm"], fitted["x"], fitted["y"]
    model = pm.stages[-1]
    # The first attempt failed after its second epoch; the second resumed after it, from the store.
    attempts = {os.path.basename(p): open(p).read() for p in glob.glob(os.path.join(fitted["outdir"], "attempt-*"))}
    assert attempts == {**{f"attempt-1-rank-{r}": "0" for r in range(RANKS)},
                        **{f"attempt-2-rank-{r}": "2" for r in range(RANKS)}}
    history = model.getHistory()
    assert len(history["loss"]) == len(history["val_accuracy"]) == EPOCHS, history
    assert history["loss"][-1] < history["loss"][0]
    prefix = f"{fitted['store']}/{model.getRunId()}"
    names = [u.rsplit("/", 1)[-1] for u in storage.list_checkpoints(f"{prefix}/checkpoints", fitted["options"])]
    assert names == [f"epoch-{i:04d}.keras" for i in range(1, EPOCHS + 1)]
    assert model.getModelUrl() == f"{prefix}/model.keras"

    records = fitted["records"]
    log_level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    model.getModel()  # the driver reads the model's shapes once; only the workers' loads count below
    # Loading on the driver left its environment alone: a later local-mode run's ranks inherit it.
    assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == log_level
    for f in os.listdir(records):
        os.remove(os.path.join(records, f))
    scored = pm.transform(fitted["test_df"].repartition(3))
    assert scored.schema["label__output"].dataType.simpleString() == "array<float>"
    distributed = _accuracy(scored)
    # Each Python worker loaded the model once, each from the store: local[2] has at most 2 of them
    # for the 3 partitions, so one of them scored two.
    loads = [name.split("-")[1] for name in os.listdir(records)]
    assert 1 <= len(loads) <= 2 and len(loads) == len(set(loads)), loads

    keras.utils.set_random_seed(0)
    one = _build()
    one.compile(optimizer=keras.optimizers.Adam(LR), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    n_train = int(1400 * 0.85)
    one.fit(x[:n_train], y[:n_train], batch_size=BATCH * RANKS, epochs=EPOCHS, verbose=0)
    alone = float(one.evaluate(x[1400:], y[1400:], verbose=0)[1])
    assert distributed > 0.85 and distributed >= alone - 0.02, (distributed, alone)


def test_batches_outnumber_the_loads_and_stacked_columns_score_as_the_vector(fitted):
    """With a small prediction batch, one worker predicts many batches and still loads the model once;
    the features as numeric columns, stacked, score as the assembled Vector does."""
    records = fitted["records"]
    model = fitted["pm"].stages[-1].copy()
    model.setBatchSize(8)
    model.getModel()
    for f in os.listdir(records):
        os.remove(os.path.join(records, f))
    df = fitted["pm"].stages[0].transform(fitted["test_df"].coalesce(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scored = model.transform(df)
    # predict_batch_udf's pandas-version FutureWarning is pyspark's, from a call the user did not make.
    assert not [w for w in caught if "fully support pandas" in str(w.message)], [str(w.message) for w in caught]
    rows = scored.select("id", "label__output").collect()
    assert len(rows) == len(fitted["y"]) - 1400 and len(rows[0][1]) == 10  # one partition: 397 rows, 50 batches
    assert len(os.listdir(records)) == 1
    # The same features as 64 numeric columns, stacked side by side: the same predictions.
    stacked = model.copy().setFeatureCols([f"p{j}" for j in range(64)])
    by_columns = {r["id"]: r["label__output"] for r in stacked.transform(fitted["test_df"].coalesce(1)).collect()}
    by_vector = {r["id"]: r["label__output"] for r in rows}
    assert sorted(by_columns) == sorted(by_vector)
    # The same rows in the same batches of 8; float32 kernels may still round the last digit differently.
    ids = sorted(by_vector)
    np.testing.assert_allclose([by_columns[i] for i in ids], [by_vector[i] for i in ids], rtol=1e-5, atol=1e-7)


def test_a_saved_pipeline_model_loads_back_and_predicts_identically(fitted, tmp_path):
    from pyspark.ml import PipelineModel

    pm, test_df = fitted["pm"], fitted["test_df"]
    path = str(tmp_path / "pipeline")
    pm.write().overwrite().save(path)
    assert "AccountKey" not in "".join(open(f).read() for f in glob.glob(f"{path}/**/metadata/part-*", recursive=True))
    loaded = PipelineModel.load(path)
    keras_model = loaded.stages[-1]
    assert type(keras_model).__name__ == "KerasModel" and keras_model.getStorageOptions() is None
    keras_model.setStorageOptions(fitted["options"])  # credentials are never saved with the model
    assert keras_model.getHistory() == pm.stages[-1].getHistory()
    before = {r["id"]: r["label__output"] for r in pm.transform(test_df).select("id", "label__output").collect()}
    after = {r["id"]: r["label__output"] for r in loaded.transform(test_df).select("id", "label__output").collect()}
    assert before == after and len(after) == len(fitted["y"]) - 1400


def _jobs_started(spark) -> int:
    return int(spark.sparkContext._jsc.sc().dagScheduler().nextJobId())


def _bad_cases():
    import keras

    ok = dict(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
              feature_cols=["features"], label_cols=["label"], store="file:///tmp/sparktrain-never-written")
    inputs = keras.Input((64,))
    two_out = keras.Model(inputs, [keras.layers.Dense(1)(inputs), keras.layers.Dense(1)(inputs)])
    return [
        ("missing column", dict(ok, feature_cols=["pixels"]), sparktrain.InvalidArgumentError, ["'pixels'", "feature_cols"]),
        ("string column", dict(ok, label_cols=["name"]), sparktrain.InvalidArgumentError, ["'name'", "string", "label_cols"]),
        ("not keras 3", dict(ok, model="a model"), sparktrain.InvalidArgumentError, ["Keras 3", "builtins.str"]),
        ("unknown scheme", dict(ok, store="nosuch://bucket/models"), sparktrain.SparkTrainError, ["nosuch"]),
        ("labels vs outputs", dict(ok, label_cols=["label", "id"]), sparktrain.InvalidArgumentError,
         ["label_cols", "2 label", "1 output"]),
        ("outputs vs labels", dict(ok, model=two_out), sparktrain.InvalidArgumentError, ["1 label", "2 output"]),
        ("bad validation", dict(ok, validation=1.5), sparktrain.InvalidArgumentError, ["validation=1.5"]),
        ("stacked vector", dict(ok, feature_cols=["features", "id"]), sparktrain.InvalidArgumentError,
         ["stacked", "Vector"]),
    ]


def test_bad_input_is_refused_before_any_spark_job(spark):
    from pyspark.ml.linalg import Vectors

    from sparktrain.ml import KerasEstimator

    df = spark.createDataFrame([(1, "a", Vectors.dense([0.0] * 64), 3)], ["id", "name", "features", "label"])
    for case, params, error, words in _bad_cases():
        params.setdefault("model", _build())
        before = _jobs_started(spark)
        with pytest.raises(error) as e:
            KerasEstimator(num_proc=2, **params).fit(df)
        assert _jobs_started(spark) == before, case
        for word in words:
            assert word in str(e.value), (case, str(e.value))
    with pytest.raises(sparktrain.UnsupportedError, match="transformation_fn"):
        KerasEstimator(transformation_fn=lambda row: row)


#: Horovod's KerasEstimator parameters (horovod/spark/keras/estimator.py and common/params.py).
HOROVOD_PARAMS = (
    "num_proc", "model", "backend", "store", "custom_objects", "optimizer", "loss", "loss_weights", "sample_weight_col",
    "gradient_compression", "metrics", "feature_cols", "label_cols", "validation", "callbacks", "batch_size",
    "val_batch_size", "epochs", "verbose", "random_seed", "shuffle_buffer_size", "shuffle", "partitions_per_process",
    "run_id", "train_steps_per_epoch", "validation_steps_per_epoch", "transformation_fn", "transformation_edit_fields",
    "transformation_removed_fields", "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type",
    "label_shapes", "checkpoint_callback", "inmemory_cache_all", "backend_env", "use_gpu", "mp_start_method",
    "compress_sparse_cols",
)


def test_the_docs_decide_every_horovod_parameter_and_say_why():
    from sparktrain.ml import NO_EFFECT, NOT_SUPPORTED, KerasEstimator

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "from-horovod.md")).read()
    rows = text[text.index("## The Spark estimator"):].splitlines()
    for name in HOROVOD_PARAMS:
        assert name in KerasEstimator._specs or name in NOT_SUPPORTED, name
        assert any(line.startswith("| ") and f"`{name}`" in line.split(" | ")[0] for line in rows), name
    for table, word in ((NOT_SUPPORTED, "refused"), (NO_EFFECT, "accepted")):
        for name, why in table.items():
            line = next(line for line in rows if line.startswith("| ") and f"`{name}`" in line.split(" | ")[0])
            assert word in line, (name, line)
            assert why.split(";")[0].split(":")[0] in line.replace("`", ""), (name, line)
