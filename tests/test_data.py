"""``run(..., data=df)`` on a real local Spark with real TensorFlow ranks: training, equal steps,
coverage and order, large data, a killed rank, and the inputs refused on the driver."""
from __future__ import annotations

import glob
import io
import json
import os
import re
import signal
import tempfile
import time

import numpy as np
import psutil
import pytest

import sparktrain
from conftest import module_spark
from helpers import wait_until, weights_digest

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)

ENV = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
spark = module_spark("local[3]")


def jobs_started(session) -> int:
    """How many Spark jobs this session has started so far."""
    return session.sparkContext._jsc.sc().dagScheduler().numTotalJobs()


def spool_dirs(run_id: str) -> list[str]:
    """The spool directories of ``run_id`` left on this machine (executors' local dirs or /tmp)."""
    pattern = f"sparktrain-{run_id}-r*-data-*"
    return glob.glob(os.path.join(tempfile.gettempdir(), pattern)) + \
        glob.glob(os.path.join(tempfile.gettempdir(), "*", pattern))


# -- training quality -------------------------------------------------------------------------------

def classification_rows(n: int = 3000):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(42)
    v, a = rng.normal(size=(n, 4)), rng.normal(size=(n, 4)).astype(np.float32)
    w = np.array([1.5, -2.0, 0.5, 1.0, -1.0, 2.0, 0.7, -0.3])
    label = (np.hstack([v, a]) @ w + 0.3 * rng.normal(size=n) > 0).astype(np.int64)
    rows = [(i, Vectors.dense(v[i]), a[i].tolist(), int(label[i])) for i in range(n)]
    return rows, np.hstack([v, a]), label


def train_logistic(outdir, batch_size, epochs):
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    ds = sparktrain.data.dataset({"v": "vec", "a": "arr"}, label="label", batch_size=batch_size, seed=1)
    v, a = keras.Input((4,), name="v"), keras.Input((4,), name="a")
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Concatenate()([v, a]))
    model = keras.Model({"v": v, "a": a}, out)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="binary_crossentropy")
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = model.get_weights()
    with open(os.path.join(outdir, f"digest-{hvd.size()}-{hvd.rank()}"), "w") as f:
        f.write(weights_digest(weights))
    return [w.tolist() for w in weights]


def accuracy(weights, x, y) -> float:
    kernel, bias = np.array(weights[0]), np.array(weights[1])
    return float((((x @ kernel)[:, 0] + bias[0] > 0).astype(int) == y).mean())


def test_three_ranks_train_as_well_as_one_process_on_the_same_rows(spark, tmp_path):
    rows, x, y = classification_rows()
    df = spark.createDataFrame(rows, ["id", "vec", "arr", "label"])
    outdir = str(tmp_path)
    three = sparktrain.run(train_logistic, args=(outdir, 32, 4), num_proc=3, data=df, env=ENV, verbose=0)
    one = sparktrain.run(train_logistic, args=(outdir, 96, 4), num_proc=1, data=df, env=ENV, verbose=0)
    acc3, acc1 = accuracy(three, x, y), accuracy(one, x, y)
    assert acc1 > 0.9, acc1
    assert abs(acc3 - acc1) <= 0.02, (acc3, acc1)
    digests = {open(os.path.join(outdir, f"digest-3-{r}")).read() for r in range(3)}
    assert len(digests) == 1  # bit-identical weights on every rank


# -- equal steps ------------------------------------------------------------------------------------

def count_steps(outdir):
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    ds = sparktrain.data.dataset("x", label="label", batch_size=64, seed=3)
    val = sparktrain.data.dataset("x", label="label", batch_size=1, name="val", shuffle=False)
    steps = []

    class Count(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] += 1

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="binary_crossentropy")
    model.fit(ds, validation_data=val, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Count()])
    with open(os.path.join(outdir, f"steps-{hvd.rank()}.json"), "w") as f:
        json.dump({"steps": steps, "cardinality": int(ds.cardinality()), "val": int(val.cardinality()),
                   "shard": sparktrain.data.shard().rows}, f)


# -- coverage and order -----------------------------------------------------------------------------

def epoch_ids(seed, epochs, name):
    import sparktrain.data

    ds = sparktrain.data.dataset("id", batch_size=7, seed=seed, prefetch=False, name=name)
    ids = [[int(i) for batch in ds for i in batch.numpy()] for _ in range(epochs)]
    x = sparktrain.data.numpy("id", name=name, uneven="drop")
    s = sparktrain.data.shard(name)
    return {"rank": sparktrain.rank(), "ids": ids, "cardinality": int(ds.cardinality()),
            "numpy": x.tolist(), "rows": s.rows, "rows_per_rank": list(s.rows_per_rank)}


def gather_epoch_ids(outdir, seed, epochs, name="ids"):
    got = epoch_ids(seed, epochs, name)
    with open(os.path.join(outdir, f"ids-{got['rank']}.json"), "w") as f:
        json.dump(got, f)


def steps_and_ids(outdir):
    """One run for both the equal steps and the order: a Keras fit on 'train' and 'val', then
    the 'ids' set read for three epochs."""
    count_steps(os.path.join(outdir, "steps"))
    gather_epoch_ids(os.path.join(outdir, "ids"), 9, 3)


@pytest.fixture(scope="module")
def uneven_run(spark, tmp_path_factory):
    """The run: 'train' in uneven partitions (the last one empty), 'val' of 4 rows on 3 ranks,
    and 'ids' of 61 rows in 5 partitions. Returns its output directory, its stderr and its data."""
    outdir = tmp_path_factory.mktemp("uneven")
    (outdir / "steps").mkdir()
    (outdir / "ids").mkdir()
    sizes = [1000, 10, 1, 0]  # the input's partitions; the last one has no rows
    parts = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(len(sizes))]
    rdd = spark.sparkContext.parallelize(parts, len(parts)).flatMap(lambda ids: [(i, float(i), i % 2) for i in ids])
    assert rdd.glom().map(len).collect() == sizes
    df = rdd.toDF(["id", "x", "label"])
    val = spark.createDataFrame([(float(i), i % 2) for i in range(4)], ["x", "label"])  # 4 rows on 3 ranks
    data = {"train": df, "val": val, "ids": spark.range(0, 61, 1, 5)}
    err = io.StringIO()
    sparktrain.run(steps_and_ids, args=(str(outdir),), num_proc=3, data=data, env=ENV, stderr=err)
    return outdir, err.getvalue(), data


def test_uneven_and_empty_partitions_run_the_same_steps_on_every_rank(uneven_run):
    outdir, log, _ = uneven_run
    got = [json.load(open(outdir / "steps" / f"steps-{r}.json")) for r in range(3)]
    assert [g["steps"] for g in got] == [[6, 6]] * 3  # ceil(337 / 64) on every rank, both epochs
    assert {g["cardinality"] for g in got} == {6} and {g["val"] for g in got} == {2}
    assert sorted(g["shard"] for g in got) == [337, 337, 337]
    assert "'train' rank shards 337/337/337 rows; wrapping to 6 steps per epoch of 64 on every rank" in log
    counts = re.search(r"'val' rank shards (\d+)/(\d+)/(\d+) rows; wrapping to 2 steps per epoch of 1", log)
    assert counts and sorted(int(c) for c in counts.groups()) == [1, 1, 2], log


def test_every_row_every_epoch_new_order_each_epoch_same_order_for_the_same_seed(uneven_run, tmp_path):
    outdir, _, data = uneven_run
    first = [json.load(open(outdir / "ids" / f"ids-{r}.json")) for r in range(3)]
    # Another run over the same data, with the same seed: the same order. (Each rank's share of a
    # set depends on all the run's sets: they are dealt out together.)
    sparktrain.run(gather_epoch_ids, args=(str(tmp_path), 9, 3), num_proc=3, data=data, verbose=0)
    again = [json.load(open(tmp_path / f"ids-{r}.json")) for r in range(3)]
    assert {r["cardinality"] for r in first} == {3}  # ceil(21 / 7) on every rank
    for epoch in range(3):
        seen = [set(r["ids"][epoch]) for r in first]
        assert set().union(*seen) == set(range(61))  # every row, every epoch
        assert all(len(r["ids"][epoch]) == 21 for r in first)
    for r in first:
        assert r["ids"][0] != r["ids"][1] != r["ids"][2]  # the order changes between epochs
        assert len(r["numpy"]) == min(r["rows_per_rank"]) and r["numpy"] == sorted(r["numpy"])
    assert [r["ids"] for r in again] == [r["ids"] for r in first]  # the same seed, the same order


# -- resources --------------------------------------------------------------------------------------

def iterate_large(outdir):
    import psutil
    import tensorflow as tf  # noqa: F401 - its own memory is not the data's

    import sparktrain.data

    def anon() -> int:  # resident memory that is not a file's pages (the mapped spool is)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

    me = psutil.Process()
    before, before_anon = me.memory_info().rss, anon()
    ds = sparktrain.data.dataset("x", batch_size=8192, seed=0)
    peak = peak_anon = rows = 0
    for batch in ds:
        rows += len(batch)
        peak, peak_anon = max(peak, me.memory_info().rss), max(peak_anon, anon())
    with open(os.path.join(outdir, f"rss-{sparktrain.rank()}.json"), "w") as f:
        json.dump({"grew": peak - before, "anon": peak_anon - before_anon, "rows": rows, "run_id": os.environ["SPARKTRAIN_RUN_ID"]}, f)


@pytest.mark.timeout(900)
def test_five_million_rows_keep_driver_and_rank_memory_bounded_and_leave_no_spool(spark, tmp_path):
    from pyspark.sql import functions as F

    df = spark.range(0, 5_000_000, 1, 6).select(
        "id", F.array(*[F.rand(i).cast("float") for i in range(16)]).alias("x"))
    driver = psutil.Process()
    before = driver.memory_info().rss
    sparktrain.run(iterate_large, args=(str(tmp_path),), num_proc=3, data=df, env=ENV, verbose=0)
    driver_growth = driver.memory_info().rss - before
    got = [json.load(open(tmp_path / f"rss-{r}.json")) for r in range(3)]
    grew = ", ".join(f"{g['grew'] / 2**20:.1f} ({g['anon'] / 2**20:.1f} anonymous)" for g in got)
    print(f"driver RSS grew {driver_growth / 2**20:.1f} MiB; the ranks' RSS grew {grew} MiB")
    assert all(g["rows"] >= 5_000_000 // 3 for g in got)
    assert driver_growth < 100 << 20, driver_growth
    assert max(g["grew"] for g in got) < 512 << 20, [g["grew"] for g in got]
    assert spool_dirs(got[0]["run_id"]) == []


def kill_my_task_mid_epoch(outdir):
    """Reads its shard in batches of 4 through numpy (no TensorFlow: the spool and the failure are
    the subject, and they are the same under tf.data), and rank 1's task dies at the fourth."""
    import sparktrain.data

    ids = sparktrain.data.numpy("id")
    with open(os.path.join(outdir, f"run-{sparktrain.rank()}"), "w") as f:
        f.write(os.environ["SPARKTRAIN_RUN_ID"] + "\n" + os.environ["SPARKTRAIN_DATA_DIR"])
    for step in range(len(ids) // 4):
        if sparktrain.rank() == 1 and step == 3:
            os.kill(os.getppid(), signal.SIGKILL)  # the Spark task's Python worker, mid-epoch
    time.sleep(120)  # the others wait to be stopped


def test_a_killed_rank_fails_the_run_by_name_and_leaves_no_spool(spark, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(kill_my_task_mid_epoch, args=(str(tmp_path),), num_proc=3, data=spark.range(0, 300),
                       env=ENV, verbose=0)
    assert e.value.root_cause.rank == 1
    assert "root cause: rank 1 " in str(e.value)
    run_id, data_dir = open(tmp_path / "run-1").read().split("\n")
    wait_until(lambda: not os.path.exists(data_dir), 30, f"rank 1's spool {data_dir} was not removed")
    wait_until(lambda: spool_dirs(run_id) == [], 30, "a spool directory was left")


# -- refused on the driver --------------------------------------------------------------------------

def test_bad_data_is_refused_before_any_spark_job(spark):
    import pandas as pd

    good = spark.range(3)
    streaming = spark.readStream.format("rate").load()
    cases = [
        ("table", r"data must be a Spark DataFrame or a dict of them.*got 'table' \(str\)"),
        ({}, r"data must be a Spark DataFrame or a dict of them.*got \{\} \(dict\)"),
        ({"train": pd.DataFrame({"x": [1]})},
         r"data\['train'\] must be a Spark DataFrame, got x 0 1 \(pandas.DataFrame\); make it a Spark DataFrame"),
        ({"": good}, r"data's names must be non-empty strings.*got ''"),
        (streaming, r"data\['train'\] is a streaming DataFrame"),
        (spark.sql("select map('a', 1) as m, current_timestamp() as t, cast(1 as double) as x"),
         r"data\['train'\] has column\(s\) of a type sparktrain cannot feed: 'm' \(map<string,int>\), "
         r"'t' \(timestamp\)\. Supported: numeric"),
        (spark.range(0), r"data\['train'\] has no rows"),
        ({"train": good, "val": good.where("false")}, r"data\['val'\] has no rows"),
        ({"val": spark.range(3).withColumnRenamed("id", "_sparktrain_row")}, r"whose names sparktrain keeps"),
    ]
    for data, message in cases:
        jobs = jobs_started(spark)
        with pytest.raises(sparktrain.InvalidArgumentError, match=message):
            sparktrain.run(lambda: 0, num_proc=2, data=data, verbose=0)
        assert jobs_started(spark) == jobs, data
    with pytest.raises(sparktrain.InvalidArgumentError, match="local mode runs without Spark"):
        sparktrain.run(lambda: 0, num_proc=-2, data=good, verbose=0)


def test_an_empty_dataframe_only_reading_can_show_is_refused_before_train_fn_starts(spark, tmp_path):
    empty = spark.createDataFrame([], "id long, x double")  # an RDD behind it: its plan cannot tell
    with pytest.raises(sparktrain.RankFailedError, match=r"data\['train'\] has no rows; there is nothing to train on"):
        sparktrain.run(lambda: open(os.path.join(str(tmp_path), "ran"), "w").close(), num_proc=2, data=empty,
                       verbose=0)
    assert not os.path.exists(tmp_path / "ran")


def ask_for(column):
    """numpy() checks the columns as dataset() does (the same builder), without TensorFlow."""
    import sparktrain.data

    sparktrain.data.numpy(column)


def test_a_column_train_fn_asks_for_that_is_not_there_is_named(spark):
    with pytest.raises(sparktrain.RankFailedError, match=r"has no column 'feature'; it has \['id'\]"):
        sparktrain.run(ask_for, args=("feature",), num_proc=2, data=spark.range(4), verbose=0)
