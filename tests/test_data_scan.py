"""``run(..., data=df)`` of a Parquet scan on a real local Spark with real ranks: the ranks read their
row groups from the files (no shuffle, no spool), a table five times the cache limit trains with
every row once per epoch and equal steps, the disk stays under the limit, a file deleted
mid-run fails the run by its name, a killed rank leaves nothing, and other plans keep the shuffle."""
from __future__ import annotations

import glob
import io
import json
import os
import signal
import tempfile
import time

import pytest

import sparktrain
from conftest import module_spark
from helpers import wait_until

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)

ENV = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
spark = module_spark("local[2]")
ROWS = 60_000
FEATURES = 8


@pytest.fixture(scope="module")
def table(spark, tmp_path_factory):
    """A Parquet table of ``ROWS`` rows (an id, a label and an array of floats) in 3 files of
    small row groups, so that each rank's share holds many."""
    from pyspark.sql import functions as F

    path = str(tmp_path_factory.mktemp("scan") / "table")
    spark.range(0, ROWS, 1, 3).select(
        "id", (F.col("id") % 2).cast("int").alias("label"),
        F.array(*[F.rand(i).cast("float") for i in range(FEATURES)]).alias("x"),
    ).write.option("parquet.block.size", 64 << 10).parquet(path)
    return path


def last_execution(session) -> tuple[str, str]:
    """The description and physical plan of the session's latest SQL execution."""
    executions = session._jsparkSession.sharedState().statusStore().executionsList()
    last = executions.apply(executions.size() - 1)
    return str(last.description()), str(last.physicalPlanDescription())


def disk(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
               if os.path.exists(os.path.join(d, f)))


def train_and_count(outdir, epochs):
    """A Keras fit with DistributedOptimizer (unequal steps would hang its collectives), then the
    ids of every epoch, with the disk the rank's data directory takes after every batch."""
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="binary_crossentropy")
    ds = sparktrain.data.dataset("x", label="label", batch_size=256, seed=5)
    history = model.fit(ds, epochs=2, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ids = sparktrain.data.dataset("id", batch_size=500, seed=5, prefetch=False)
    data_dir = os.environ["SPARKTRAIN_DATA_DIR"]
    epochs_seen, peak = [], 0
    for _ in range(epochs):
        seen = []
        for batch in ids:
            seen.extend(int(i) for i in batch.numpy())
            peak = max(peak, disk(data_dir))
        epochs_seen.append(seen)
    s = sparktrain.data.shard()
    got = {"rank": hvd.rank(), "epochs": epochs_seen, "rows": s.rows, "rows_per_rank": list(s.rows_per_rank),
           "cardinality": int(ids.cardinality()), "kind": type(s).__name__, "limit": s.cache.limit,
           "largest_row_group": max(p.nbytes for p in s.pieces), "shard_bytes": sum(p.nbytes for p in s.pieces),
           "peak_disk": peak, "cached": len(s.cache.held), "row_groups": len(s.pieces),
           "fit_epochs": len(history.history["loss"]), "data_dir": data_dir}
    with open(os.path.join(outdir, f"rank-{hvd.rank()}.json"), "w") as f:
        json.dump(got, f)


def test_a_table_five_times_the_cache_limit_trains_with_every_row_once_per_epoch(spark, table, tmp_path):
    df = spark.read.parquet(table).select("id", "label", "x")
    limit = 160 << 10  # each rank's share is about 1.2 MiB uncompressed: 7x this
    err = io.StringIO()
    sparktrain.run(train_and_count, args=(str(tmp_path), 3), num_proc=2, data=df, stderr=err,
                   env={**ENV, "SPARKTRAIN_DATA_CACHE_LIMIT": str(limit)})
    description, plan = last_execution(spark)
    assert description.startswith("sparktrain.run(train_and_count)"), description
    assert "Exchange" not in plan, plan  # the stage read one row per task: no shuffle
    got = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    assert {g["kind"] for g in got} == {"StreamShard"}
    assert sum(got[0]["rows_per_rank"]) == ROWS and got[0]["rows_per_rank"] == got[1]["rows_per_rank"]
    assert abs(got[0]["rows"] - got[1]["rows"]) <= max(g["largest_row_group"] for g in got)  # rows, at worst
    steps = max(-(-r // 500) for r in got[0]["rows_per_rank"])
    assert {g["cardinality"] for g in got} == {steps} and {g["fit_epochs"] for g in got} == {2}
    everything = set()
    for g in got:
        assert g["shard_bytes"] >= 5 * g["limit"] == 5 * limit, g
        assert 0 < g["cached"] < g["row_groups"]  # some row groups read from the cache, the rest again
        assert g["peak_disk"] <= g["limit"] + g["largest_row_group"], g
        for seen in g["epochs"]:
            assert len(seen) == steps * 500  # the same steps on every rank
            assert len(set(seen[:g["rows"]])) == g["rows"]  # every row once before any twice
            assert set(seen) == set(seen[:g["rows"]])
        assert g["epochs"][0] != g["epochs"][1] != g["epochs"][2]  # a new order every epoch
        everything |= set(g["epochs"][0])
    assert everything == set(range(ROWS))
    assert "sparktrain.data: 'train' rank shards" in err.getvalue()
    wait_until(lambda: not any(os.path.exists(g["data_dir"]) for g in got), 30, "the ranks' caches were not removed")


def shard_kind_and_ids(outdir):
    import sparktrain.data

    s = sparktrain.data.shard()
    ids = sparktrain.data.numpy("id")[:s.rows]
    with open(os.path.join(outdir, f"rank-{sparktrain.rank()}.json"), "w") as f:
        json.dump({"kind": type(s).__name__, "ids": ids.tolist(), "rows": list(s.rows_per_rank)}, f)


def test_a_plan_that_is_not_a_plain_scan_goes_through_one_shuffle(spark, table, tmp_path):
    df = spark.read.parquet(table).where("id % 3 = 0").select("id")
    sparktrain.run(shard_kind_and_ids, args=(str(tmp_path),), num_proc=2, data=df, env=ENV, verbose=0)
    got = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    assert {g["kind"] for g in got} == {"Shard"}
    assert sum(got[0]["rows"]) == ROWS // 3
    assert sorted(got[0]["ids"] + got[1]["ids"]) == list(range(0, ROWS, 3))
    assert "Exchange" in last_execution(spark)[1]


def test_a_filter_the_ranks_can_evaluate_keeps_the_scan_and_its_exact_counts(spark, table, tmp_path):
    df = spark.read.parquet(table).where("label = 1 and id >= 1000 and id not in (1001, 1003)").select("id")
    log = io.StringIO()
    import logging

    handler = logging.StreamHandler(log)
    logging.getLogger("sparktrain").addHandler(handler)
    try:
        sparktrain.run(shard_kind_and_ids, args=(str(tmp_path),), num_proc=2, data=df, env=ENV, verbose=1)
    finally:
        logging.getLogger("sparktrain").removeHandler(handler)
    got = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    want = [i for i in range(1000, ROWS) if i % 2 == 1 and i not in (1001, 1003)]
    assert {g["kind"] for g in got} == {"StreamShard"}, log.getvalue()
    assert sum(got[0]["rows"]) == len(want)  # counted before the first step, exactly
    assert sorted(got[0]["ids"] + got[1]["ids"]) == want
    assert "is read by the ranks from its files" in log.getvalue()


def test_a_keras_estimator_fits_on_a_scan_split_by_its_validation_column(spark, table, tmp_path):
    import keras
    from pyspark.sql import functions as F

    from sparktrain.ml import KerasEstimator

    path = str(tmp_path / "with_val")
    spark.read.parquet(table).withColumn("is_val", F.col("id") % 10 == 0).write.parquet(path)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1, activation="sigmoid")])
    est = KerasEstimator(model=model, optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                         feature_cols=["x"], label_cols=["label"], validation="is_val", batch_size=512, epochs=2,
                         num_proc=2, verbose=1, env=ENV, store=f"file://{tmp_path}/store")
    log = io.StringIO()
    import logging

    handler = logging.StreamHandler(log)
    logging.getLogger("sparktrain").addHandler(handler)
    try:
        fitted = est.fit(spark.read.parquet(path))
    finally:
        logging.getLogger("sparktrain").removeHandler(handler)
    history = fitted.getHistory()
    assert len(history["loss"]) == 2 and len(history["val_loss"]) == 2, history
    for name in ("train", "val"):  # both halves of the split read from the files, no shuffle
        assert f"data[{name!r}] is read by the ranks from its files" in log.getvalue(), log.getvalue()


def test_an_orc_scan_is_read_by_the_ranks_a_file_each(spark, tmp_path):
    path = str(tmp_path / "orc")
    spark.range(0, 3000, 1, 4).write.orc(path)
    df = spark.read.orc(path).where("id >= 100")
    sparktrain.run(shard_kind_and_ids, args=(str(tmp_path),), num_proc=2, data=df, env=ENV, verbose=0)
    got = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    assert {g["kind"] for g in got} == {"StreamShard"}
    assert sorted(got[0]["ids"] + got[1]["ids"]) == list(range(100, 3000))
    assert sum(got[0]["rows"]) == 2900 and max(got[0]["rows"]) - min(got[0]["rows"]) <= 750  # one file, at most


def delete_a_file_after_the_first_epoch(outdir):
    """With nothing cached, the second epoch reads the files again; rank 0 deletes the file of its
    first row group (once every rank has read its first epoch: an allreduce waits for them)."""
    import sparktrain.data

    ds = sparktrain.data.dataset("id", batch_size=100, seed=1, prefetch=False)
    for _ in ds:
        pass
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    hvd.allreduce(tf.constant(0.0))
    s = sparktrain.data.shard()
    if sparktrain.rank() == 0:
        victim = s.pieces[0].path
        with open(os.path.join(outdir, "victim"), "w") as f:
            f.write(victim)
        os.remove(victim.removeprefix("file://"))
    hvd.allreduce(tf.constant(0.0))
    for _ in ds:
        pass


def test_a_file_deleted_mid_run_fails_the_run_by_its_name(spark, table, tmp_path):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(table, copy)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(delete_a_file_after_the_first_epoch, args=(str(tmp_path),), num_proc=2,
                       data=spark.read.parquet(copy), env={**ENV, "SPARKTRAIN_DATA_CACHE_LIMIT": "0"}, verbose=0)
    victim = open(tmp_path / "victim").read()  # its row groups may be any rank's: the first to reach one fails
    assert f"could not open {victim} of the DataFrame fed as 'train'" in e.value.root_cause.message, str(e.value)


def no_rank_directory_left(run_id: str) -> None:
    pattern = f"sparktrain-{run_id}-r*"
    wait_until(lambda: not glob.glob(os.path.join(tempfile.gettempdir(), pattern))
               and not glob.glob(os.path.join(tempfile.gettempdir(), "*", pattern)), 30, "a rank's directory was left")


def kill_my_task_mid_epoch(outdir):
    import sparktrain.data

    ds = sparktrain.data.dataset("id", batch_size=100, seed=1, prefetch=False)
    mine = os.path.join(outdir, f"run-{sparktrain.rank()}")
    with open(mine + ".part", "w") as f:
        f.write(os.environ["SPARKTRAIN_RUN_ID"] + "\n" + os.environ["SPARKTRAIN_DATA_DIR"])
    os.rename(mine + ".part", mine)
    for step, _ in enumerate(ds):
        if sparktrain.rank() == 1 and step == 150:  # some row groups are in the cache by now
            assert os.listdir(os.path.join(os.environ["SPARKTRAIN_DATA_DIR"], "train.cache"))
            deadline = time.monotonic() + 60  # rank 0 has said where its cache is (a loaded machine starts it late)
            while not os.path.exists(os.path.join(outdir, "run-0")) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getppid(), signal.SIGKILL)  # the Spark task's Python worker, mid-epoch
    time.sleep(120)  # the others wait to be stopped


def test_a_killed_rank_fails_the_run_by_name_and_leaves_no_cache(spark, table, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(kill_my_task_mid_epoch, args=(str(tmp_path),), num_proc=2, data=spark.read.parquet(table),
                       env=ENV, verbose=0)
    assert e.value.root_cause.rank == 1
    for r in range(2):
        run_id, data_dir = open(tmp_path / f"run-{r}").read().split("\n")
        wait_until(lambda: not os.path.exists(data_dir), 30, f"rank {r}'s cache {data_dir} was not removed")
    no_rank_directory_left(run_id)


DRIVER = """
import os, sys, time
import sparktrain
from sparktrain.driver.launch.cluster import start_session

def stream_then_wait(outdir):
    import sparktrain.data
    ds = sparktrain.data.dataset("id", batch_size=100, seed=1, prefetch=False)
    mine = os.path.join(outdir, f"rank-{sparktrain.rank()}")
    for step, _ in enumerate(ds):
        if step == 100:  # mid-epoch, with row groups in the cache
            assert os.listdir(os.path.join(os.environ["SPARKTRAIN_DATA_DIR"], "train.cache"))
            with open(mine + ".part", "w") as f:
                f.write(f"{os.getpid()}\\n{os.environ['SPARKTRAIN_RUN_ID']}\\n{os.environ['SPARKTRAIN_DATA_DIR']}")
            os.rename(mine + ".part", mine)
            time.sleep(300)  # the test kills the driver now

spark = start_session("local[2]")
sparktrain.run(stream_then_wait, args=(sys.argv[2],), num_proc=2, data=spark.read.parquet(sys.argv[1]), verbose=0,
               env={"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"})
"""


@pytest.mark.timeout(300)
def test_a_driver_killed_mid_stream_leaves_no_rank_cache_or_directory(table, tmp_path):
    import subprocess
    import sys

    from helpers import wait_pids_gone

    log = open(tmp_path / "driver.log", "w")  # a file, not a pipe no one reads while the driver runs
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, table, str(tmp_path)], stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        wait_until(lambda: driver.poll() is not None or all((tmp_path / f"rank-{r}").exists() for r in range(2)),
                   180, "both ranks streaming")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        driver.send_signal(signal.SIGKILL)  # our own child: Popen holds it until we wait
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
    ranks = [open(tmp_path / f"rank-{r}").read().split("\n") for r in range(2)]
    assert wait_pids_gone([int(pid) for pid, _, _ in ranks], timeout=60) == []
    for pid, run_id, data_dir in ranks:
        wait_until(lambda: not os.path.exists(data_dir), 30, f"the cache {data_dir} of rank pid {pid} was not removed")
    no_rank_directory_left(ranks[0][1])


def test_a_scan_with_nulls_or_no_rows_is_refused_before_any_spark_job(spark, tmp_path):
    from pyspark.sql import functions as F

    nulls = str(tmp_path / "nulls")
    spark.range(0, 10, 1, 1).select(F.when(F.col("id") > 2, F.col("id")).alias("v")).write.parquet(nulls)
    empty = str(tmp_path / "empty")
    spark.range(0, 0, 1, 1).write.parquet(empty)
    with_nulls, without_rows = spark.read.parquet(nulls), spark.read.parquet(empty)  # reading the schema is a job
    jobs = spark.sparkContext._jsc.sc().dagScheduler().numTotalJobs()
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"data\['train'\]: column 'v' has 3 null value"):
        sparktrain.run(lambda: 0, num_proc=2, data=with_nulls, verbose=0)
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"data\['train'\] has no rows"):
        sparktrain.run(lambda: 0, num_proc=2, data=without_rows, verbose=0)
    assert spark.sparkContext._jsc.sc().dagScheduler().numTotalJobs() == jobs


#: What the environment says of S3 in this test: no credentials, and an endpoint where nothing
#: listens, so that a read without the run's storage_options fails here, never reaching elsewhere.
NO_S3 = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}


def shard_of_a_scan_on_s3(outdir):
    # No credentials, nor the server's address, in the rank's environment: run()'s storage_options alone.
    credentials = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    assert not [k for k in credentials if k in os.environ], sorted(os.environ)
    assert all(os.environ.get(k) == v for k, v in NO_S3.items())
    shard_kind_and_ids(outdir)


@pytest.fixture
def s3_table(spark, moto_s3, tmp_path, monkeypatch):
    """A Parquet table in a new bucket of moto's S3, as Spark plans it: ``s3a://<bucket>/table``.

    This suite has no S3A connector for Spark, so Spark plans the scan through a Hadoop mount of the
    bucket's path onto a local copy of the same files (``ViewFileSystemOverloadScheme``); sparktrain
    reads the files the plan names, ``s3a://...``, from moto's S3 with fsspec. The environment has no
    AWS credentials (``NO_S3``): the store is reached only with the run's storage_options."""
    import uuid

    from sparktrain import storage

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in NO_S3.items():
        monkeypatch.setenv(name, value)
    local = str(tmp_path / "local-table")
    spark.range(0, 4000, 1, 2).write.option("parquet.block.size", 16 << 10).parquet(local)
    bucket = f"scan-{uuid.uuid4().hex[:8]}"
    fs, _ = storage.filesystem("s3://x", moto_s3)
    fs.mkdir(bucket)
    for name in os.listdir(local):
        if name.endswith(".parquet"):
            fs.put_file(os.path.join(local, name), f"{bucket}/table/{name}")
    hadoop = spark._jsc.hadoopConfiguration()
    mount = {"fs.s3a.impl": "org.apache.hadoop.fs.viewfs.ViewFileSystemOverloadScheme",
             "fs.s3a.impl.disable.cache": "true",
             "fs.viewfs.overload.scheme.target.file.impl": "org.apache.hadoop.fs.LocalFileSystem",
             f"fs.viewfs.mounttable.{bucket}.link./table": f"file://{local}"}
    for key, value in mount.items():
        hadoop.set(key, value)
    try:
        yield f"s3a://{bucket}/table"
    finally:
        for key in mount:
            hadoop.unset(key)


def test_a_scan_on_s3_is_read_by_the_ranks_with_the_runs_storage_options(spark, s3_table, moto_s3, tmp_path):
    """The driver reads the footers, one Spark job counts the filter's rows, and 2 ranks read their row
    groups, all from S3 with ``run(storage_options=)`` alone."""
    df = spark.read.parquet(s3_table).where("id >= 100")
    assert all(f.startswith("s3a://") for f in df.inputFiles())
    sparktrain.run(shard_of_a_scan_on_s3, args=(str(tmp_path),), num_proc=2, data=df, env={**ENV, **NO_S3},
                   verbose=0, storage_options=moto_s3)
    got = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    assert {g["kind"] for g in got} == {"StreamShard"}
    assert sorted(got[0]["ids"] + got[1]["ids"]) == list(range(100, 4000))
    assert sum(got[0]["rows"]) == 3900 and all(got[0]["rows"])

