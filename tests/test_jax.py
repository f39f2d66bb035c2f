"""Keras 3 on JAX across 3 real ranks of a local[3] Spark (``run(..., backend="jax")``).

One run (module-scoped) feeds the digits as a DataFrame and fits a ``DataParallel`` model with
``sparktrain.data.pydataset``; the tests read what it recorded: the launch's environment, equal
weights on every rank, accuracy against the same model trained in one process, every row fed,
equal steps, no TensorFlow, quiet output. A second run has a rank raise while the others wait in
a JAX collective.
"""
from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

import sparktrain
from conftest import module_spark
from helpers import (digits_mlp, digits_mlp_accuracy, fault_time, mark_time, read_ranks, read_time, record_rank,
                     skip_without_jax, wait_for_ranks, wait_pids_gone)

skip_without_jax()
pytestmark = [pytest.mark.timeout(240), pytest.mark.jax]

spark = module_spark("local[3]")
#: Rows per rank per step: the global batch is 3 x 32.
BATCH, EPOCHS, RANKS = 32, 20, 3


def fit_digits(outdir: str, x_test, y_test, x_all, y_all):
    import sys

    import jax
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd

    ds = sparktrain.data.pydataset("features", label="label", batch_size=BATCH, seed=3)
    ds[0]
    # Keras' seed sync in initialize() imports TensorFlow where it is installed; the feed and
    # sparktrain.keras must not.
    fed_without_tensorflow = "tensorflow" not in sys.modules
    keras.utils.set_random_seed(1)  # initialize() keeps a seed already set: the one process's start below
    hvd.init()  # keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.Adam())
    except sparktrain.SparkTrainError as e:
        refused = str(e)
    r = hvd.rank()
    checkpoints = [hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=os.path.join(outdir, f"best-{r}.keras")),
                   hvd.callbacks.RemoteCheckpoint(f"file://{outdir}/remote-{r}/epoch-{{epoch}}.keras")]
    steps = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    model = digits_mlp()
    model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[Count(), *checkpoints])
    weights = [np.asarray(w) for w in model.get_weights()]
    hvd.save_model(model, os.path.join(outdir, f"saved-{r}.keras"))
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("rank 0 saved")  # rank 0 saves alone; nobody waits for it
    restored, epoch = hvd.restore(f"file://{outdir}/remote-0")
    shard = sparktrain.data.shard("train")
    ids = shard.column("id").take(shard.epoch_rows(0, shard.rows, False, 0))
    got = {"steps": len(steps), "len": len(ds), "ids": sorted(int(i) for i in ids),
           "process": [jax.process_index(), jax.process_count(), jax.device_count()],
           "jax_env": {k: os.environ.get(k) for k in ("KERAS_BACKEND", "KERAS_DISTRIBUTION_JOB_ADDRESSES",
                                                      "KERAS_DISTRIBUTION_NUM_PROCESSES",
                                                      "KERAS_DISTRIBUTION_PROCESS_ID", "JAX_PLATFORMS",
                                                      "JAX_NUM_CPU_DEVICES", "MASTER_ADDR", "MASTER_PORT")},
           "digest": __import__("hashlib").sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
           "accuracy": digits_mlp_accuracy(weights, x_test, y_test), "refused": refused, "restored_epoch": epoch,
           "restored_same": restored is not None and all(np.array_equal(np.asarray(a), b) for a, b in
                                                         zip(restored.get_weights(), weights))}
    if sparktrain.rank() == 0:
        # The same model and global batch, trained in this one process.
        keras.distribution.set_distribution(None)
        keras.utils.set_random_seed(1)
        alone = digits_mlp()
        alone.fit(x_all, y_all, batch_size=BATCH * RANKS, epochs=EPOCHS, verbose=0)
        got["alone"] = digits_mlp_accuracy([np.asarray(w) for w in alone.get_weights()], x_test, y_test)
    got["fed_without_tensorflow"] = fed_without_tensorflow
    record_rank(outdir, got=got)
    return got


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    train, test = order[:1500], order[1500:]
    df = spark.createDataFrame([(int(i), x[i].tolist(), int(y[i])) for i in train], "id long, features array<float>, "
                               "label int")
    outdir = str(tmp_path_factory.mktemp("jax"))
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    result = sparktrain.run(fit_digits, args=(outdir, x[test], y[test], x[train], y[train]), num_proc=RANKS,
                            backend="jax", data=df, stdout=out, stderr=err, timeout=200)
    print(f"3-rank JAX run: {time.monotonic() - started:.1f} s")
    return {"ranks": read_ranks(outdir), "result": result, "out": out.getvalue(), "err": err.getvalue(),
            "train": train, "files": sorted(os.listdir(outdir))}


def test_each_rank_gets_the_jax_launch_and_joins_one_process_group(fitted):
    ranks = fitted["ranks"]
    assert sorted(ranks) == [0, 1, 2]
    coordinator = f"{ranks[0]['env']['MASTER_ADDR']}:{ranks[0]['env']['MASTER_PORT']}"
    for r, info in ranks.items():
        env = info["got"]["jax_env"]
        assert env["KERAS_BACKEND"] == "jax" and env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == coordinator
        assert (env["KERAS_DISTRIBUTION_NUM_PROCESSES"], env["KERAS_DISTRIBUTION_PROCESS_ID"]) == ("3", str(r))
        assert (env["JAX_PLATFORMS"], env["JAX_NUM_CPU_DEVICES"]) == ("cpu", "1")
        assert info["got"]["process"] == [r, 3, 3]  # JAX's process index is the sparktrain rank
        assert info["got"]["fed_without_tensorflow"] is True  # sparktrain.data's PyDataset needs no TensorFlow


def test_data_parallel_fit_ends_with_the_same_weights_and_the_accuracy_of_one_process(fitted):
    ranks = fitted["ranks"]
    assert len({info["got"]["digest"] for info in ranks.values()}) == 1
    got = ranks[0]["got"]
    print(f"accuracy: 3 ranks {got['accuracy']:.4f}, one process {got['alone']:.4f}")
    assert got["accuracy"] > 0.9
    assert abs(got["accuracy"] - got["alone"]) <= 0.02
    assert fitted["result"]["digest"] == got["digest"]  # run returned rank 0's value


def test_fed_rows_are_each_one_ranks_and_every_rank_runs_the_same_steps(fitted):
    ranks = fitted["ranks"]
    ids = [i for info in ranks.values() for i in info["got"]["ids"]]
    assert sorted(ids) == sorted(int(i) for i in fitted["train"])  # every row is someone's, once
    steps = {info["got"]["steps"] for info in ranks.values()}
    lengths = {info["got"]["len"] for info in ranks.values()}
    longest = max(len(info["got"]["ids"]) for info in ranks.values())
    assert lengths == {-(-longest // BATCH)} and steps == {EPOCHS * lengths.pop()}


def test_jax_start_up_and_shutdown_lines_are_quiet(fitted):
    both = fitted["out"] + fitted["err"]
    assert "[Gloo]" not in both and "WatchTasksAsync" not in both, both[-3000:]
    assert "sparktrain.data: 'train' rank shards" in fitted["err"]  # rank 0's own lines still pass


def test_sparktrain_keras_saves_from_rank_0_alone_and_refuses_what_is_tensorflows(fitted):
    files = fitted["files"]
    assert [f for f in files if f.startswith(("best-", "saved-", "remote-"))] == ["best-0.keras", "remote-0",
                                                                                   "saved-0.keras"]
    for info in fitted["ranks"].values():
        got = info["got"]
        assert "PartialDistributedOptimizer works on the TensorFlow backend only" in got["refused"]
        assert "keras.distribution" in got["refused"]
        # Every rank reads rank 0's last checkpoint back.
        assert got["restored_epoch"] == EPOCHS and got["restored_same"], got["restored_epoch"]


# -- a rank raises while the others wait in a JAX collective -----------------------------------------

def raise_in_collective(outdir: str, how: str = "raise"):
    import jax
    from jax.experimental import multihost_utils

    import sparktrain.jax

    record_rank(outdir)
    sparktrain.jax.initialize()
    multihost_utils.sync_global_devices("all here")  # every process has joined
    if sparktrain.rank() == 1:
        wait_for_ranks(outdir, 3)
        mark_time(outdir, "raised")
        if how == "kill":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails in JAX")
    multihost_utils.sync_global_devices("never")  # waits for rank 1, which never comes
    return jax.process_index()


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_that_raises_or_is_killed_fails_a_jax_run_at_once_naming_it(spark, tmp_path, how):
    outdir = str(tmp_path)
    with pytest.raises(sparktrain.RankFailedError) as e:
        # JAX's own shutdown would hold the failed rank for minutes; the run's timeout is far shorter.
        sparktrain.run(raise_in_collective, args=(outdir, how), num_proc=3, backend="jax", verbose=0, timeout=90)
    failed_at = time.time()
    root = e.value.root_cause
    if how == "raise":
        assert (root.rank, root.exc_type, root.message) == (1, "RuntimeError", "rank 1 fails in JAX")
    else:
        # Named with its signal. A peer's gloo error may come first in time: gloo fails at once when
        # the killed process's sockets close, and the driver's stop may reach rank 1's task before
        # its exit shows there; a SIGKILL its task did not send still makes it rank 1's own failure.
        failures = e.value.failures
        assert 1 in failures and failures[1].exitcode == -9 and "rank 1" in str(e.value), e.value
    ranks = read_ranks(outdir)
    assert sorted(ranks) == [0, 1, 2]
    assert wait_pids_gone([r["pid"] for r in ranks.values()], timeout=5) == []
    fault_time(f"JAX rank {how}s in a collective", 5, failed_at - read_time(outdir, "raised"))
    print(f"JAX rank ({how}); the run failed {failed_at - read_time(outdir, 'raised'):.2f} s later")


# -- model parallelism across ranks ---------------------------------------------------------------------

def fit_model_parallel(x, y):
    import keras

    import sparktrain
    import sparktrain.jax

    keras.utils.set_random_seed(7)  # initialize() keeps a seed already set
    keras.distribution.initialize()
    try:
        sparktrain.jax.device_mesh((4, 2), ("model", "batch"))
    except sparktrain.InvalidArgumentError as e:
        refused = str(e)
    # Devices come rank by rank: the first axis spans the ranks, so the kernel is split between them,
    # and each rank's 2 devices split the batch (every rank feeds the whole batch).
    layout = keras.distribution.LayoutMap(sparktrain.jax.device_mesh((2, 2), ("model", "batch")))
    layout[".*hidden/kernel"] = (None, "model")
    layout[".*hidden/bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch", auto_shard_dataset=False))

    def mlp():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                                  keras.layers.Dense(10, name="out")])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = mlp()
    kernel = model.get_layer("hidden").kernel.value
    shards = sorted({(s.index[1].start or 0, s.index[1].stop) for s in kernel.addressable_shards})
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    from jax.experimental import multihost_utils

    # A variable split across processes is read whole by gathering it, on every rank.
    weights = [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in model.weights]
    got = {"shards": shards, "refused": refused}
    if sparktrain.rank() == 0:  # the same model, seed and batches in this one process
        keras.distribution.set_distribution(None)
        keras.utils.set_random_seed(7)
        alone = mlp()
        alone.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        got["max_difference"] = max(float(np.max(np.abs(a - b))) for a, b in zip(alone.get_weights(), weights))
    return got


def test_model_parallel_shards_a_kernel_across_2_ranks_of_2_devices_and_trains_as_one_process(spark):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x[:512] / 16).astype(np.float32), y[:512].astype(np.int32)
    got = sparktrain.run(fit_model_parallel, args=(x, y), num_proc=2, backend="jax", verbose=0, timeout=200,
                         env={"JAX_NUM_CPU_DEVICES": "2"})
    assert got["shards"] == [(0, 16)]  # rank 0 holds half the hidden kernel's columns, on both its devices
    assert "a device mesh of shape (4, 2) holds 8 devices, but this run has 2 process(es) x 2 device(s)" in \
        got["refused"]
    assert got["max_difference"] < 1e-4, got


# -- KerasEstimator ---------------------------------------------------------------------------------------

class _RecordBackend:
    """A Keras callback (made one in the rank) that leaves ``<backend>-<rank>`` in ``outdir/backends``."""

    def __new__(cls, outdir):
        import keras

        class Record(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                import sparktrain

                os.makedirs(os.path.join(outdir, "backends"), exist_ok=True)
                open(os.path.join(outdir, "backends", f"{keras.backend.backend()}-{sparktrain.rank()}"), "w").close()

        return Record()


@pytest.fixture
def keras_here():
    """Keras in this process (the estimator takes a model); its import sets TF_CPP_MIN_LOG_LEVEL in
    os.environ (as jax's does), which later runs' ranks in this process would inherit: put it back."""
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    import keras

    yield keras
    if level is None:
        os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    else:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = level


def test_keras_estimator_fits_on_jax_ranks_and_its_model_scores_a_dataframe(spark, tmp_path, keras_here):
    keras = keras_here
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    from sparktrain.ml import KerasEstimator

    x, y = load_digits(return_X_y=True)
    rows = [(Vectors.dense(x[i] / 16.0), int(y[i])) for i in range(len(y))]
    train_df, test_df = spark.createDataFrame(rows[:1400], ["features", "label"]), spark.createDataFrame(
        rows[1400:], ["features", "label"])
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    est = KerasEstimator(model=model, optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                         metrics=["accuracy"], feature_cols=["features"], label_cols=["label"], validation=0.15,
                         batch_size=32, epochs=10, num_proc=2, store=f"file://{tmp_path}/store", verbose=0,
                         callbacks=[_RecordBackend(str(tmp_path))],
                         env={"KERAS_BACKEND": "jax"})  # the ranks' backend, as the driver's KERAS_BACKEND would
    fitted = est.fit(train_df)
    history = fitted.getHistory()
    assert sorted(os.listdir(tmp_path / "backends")) == ["jax-0", "jax-1"]
    assert len(history["loss"]) == len(history["val_accuracy"]) == 10 and history["loss"][-1] < history["loss"][0]
    scored = fitted.transform(test_df).select("label", "label__output").collect()
    accuracy = float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in scored]))
    print(f"KerasEstimator on JAX: test accuracy {accuracy:.3f}")
    assert accuracy > 0.85

