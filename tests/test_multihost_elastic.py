"""The multi-host tier, elastic runs and stalls across hosts: a host lost, a host back, a stall report, a decommissioned worker (the cluster: tests/multihost_cluster.py)."""
from __future__ import annotations

import glob
import logging
import os
import re
import time

import pytest

from helpers import fault_time
from multihost_cluster import HOSTS, MARKS, PER_HOST, when_running, work_dirs

import sparktrain
from sparktrain.storage import home as homes

pytestmark = MARKS


def elastic_fit(outdir, epochs, fault_epoch, grow_to=None, batch_size=16, hold_for_resize=False):
    """A Keras fit from data=df that commits every epoch through hvd.elastic; marks running when every
    rank of the first attempt begins ``fault_epoch`` (0-based). With ``grow_to``, it trains until it
    has run 3 epochs at that size (or ``epochs``). Rank 0 returns what the test checks."""
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd
    from helpers import mark_time, record_rank, weights_digest

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(2e-3)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    sizes, resumed_at = [], []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size()), lambda: resumed_at.append(state.batch)])
    first_size = hvd.size()

    class Mark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if epoch == fault_epoch and hvd.size() == first_size and not sizes and not hold_for_resize:
                mark_time(outdir, f"running-{hvd.rank()}")

        def on_train_batch_end(self, batch, logs=None):
            # With hold_for_resize, the ranks of the first attempt say they run once batch 5 of
            # fault_epoch is done, and wait at batch 10 until rank 0 has seen the driver's resize
            # marker: it comes after batch 5 and before the epoch's end, whatever the timing.
            if hold_for_resize and self.epoch == fault_epoch and batch == 5 and not sizes:
                mark_time(outdir, f"running-{hvd.rank()}")
            if hold_for_resize and self.epoch == fault_epoch and batch == 10 and not sizes:
                import time

                from sparktrain.tensorflow import resize

                for _ in range(1800):  # every rank asks together (a broadcast), so all leave together
                    if resize.requested():
                        break
                    time.sleep(0.05)

        def on_epoch_end(self, epoch, logs=None):
            if hvd.size() == grow_to and epoch + 1 >= began[-1] + 3:
                self.model.stop_training = True  # the same on every rank: they share size and epoch

    began = []

    @hvd.elastic.run
    def train(state):
        began.append(state.epoch)  # after elastic.run restored the last commit
        ds = sparktrain.data.dataset("features", label="label", batch_size=batch_size, seed=3)
        state.model.fit(ds, epochs=epochs, initial_epoch=state.epoch, verbose=0, callbacks=[
            hvd.callbacks.MetricAverageCallback(), hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10_000), Mark()])
        return state.epoch

    train(state)
    shard = sparktrain.data.shard()
    record_rank(outdir, digest=weights_digest(state.model.get_weights()), size=hvd.size(), sizes=sizes,
                resumed_at=resumed_at,
                rows_per_rank=list(shard.rows_per_rank), steps=shard.steps_per_epoch(16), began=began,
                shard=type(shard).__name__)
    x, y = __import__("helpers").digits()[1]
    return float(state.model.evaluate(x, y, verbose=0)[1]) if hvd.rank() == 0 else None


@pytest.mark.timeout(420)
def test_an_elastic_fit_loses_a_host_and_finishes_on_the_other(cluster, tmp_path, caplog):
    """run_elastic of 4 ranks (min 2) from data=df, a Parquet scan the ranks read from its files:
    host 1 dies whole in epoch 3. The run goes on with the other host's 2 ranks from the epoch-2
    commit, the scan's row groups split again over 2, finishes every epoch with equal weights, as
    accurate as an uninterrupted run; nothing of it is left on the dead host once it is back."""
    import logging

    from helpers import digits, read_ranks
    from sparktrain.driver.launch import cluster as capacity

    hosts, standalone, session = cluster
    (x, y), _ = digits()
    table = str(tmp_path / "digits.parquet")  # 8 files of one row group: 2 a rank, then 4
    session.createDataFrame([([float(v) for v in x[i]], int(y[i])) for i in range(len(y))],
                            ["features", "label"]).repartition(8).write.parquet(table)
    df = session.read.parquet(table)
    files = sorted(glob.glob(os.path.join(table, "*.parquet")))
    import pyarrow.parquet as pq

    largest = max(pq.ParquetFile(f).metadata.num_rows for f in files)
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "TF_CPP_MIN_LOG_LEVEL": "2",
           "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    epochs, n = 6, HOSTS * PER_HOST
    caplog.set_level(logging.INFO, logger="sparktrain")  # verbose=1 logs at INFO too
    outdir = tmp_path / "elastic"
    outdir.mkdir()
    thread, _ = when_running(outdir, n, lambda: hosts.kill_host(1))
    try:
        accuracy = sparktrain.run_elastic(elastic_fit, args=(str(outdir), epochs, 2), num_proc=n, min_num_proc=2,
                                          max_num_proc=n, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(outdir))
        survivors = [r for r in ranks if ranks[r]["size"] == 2]
        assert sorted(survivors) == [0, 1], ranks
        assert len({ranks[r]["digest"] for r in survivors}) == 1  # the 2 ranks end equal
        assert all(ranks[r]["began"] == [2] for r in survivors)  # resumed from the epoch-2 commit
        assert all(ranks[r]["sizes"] == [2] for r in survivors)  # the reset callbacks ran once, with the new size
        rows = ranks[0]["rows_per_rank"]  # the 2 survivors' shares of the scan: every row, a row group apart at most
        assert len(rows) == 2 and sum(rows) == len(y), rows
        assert max(rows) - min(rows) <= largest and ranks[0]["steps"] * 16 >= max(rows), (rows, largest)
        assert ranks[0]["shard"] == ranks[1]["shard"] == "StreamShard", ranks
        lines = [r.getMessage() for r in caplog.records if "continuing with 2 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and "from the last commit, at epoch 2" in lines[0], lines
    finally:
        standalone.start_worker(1)
        conf = dict(session.sparkContext.getConf().getAll())
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)
    # The dead host's directories went with the next run's start; an uninterrupted run for comparison.
    plain = tmp_path / "plain"
    plain.mkdir()
    baseline = sparktrain.run(elastic_fit, args=(str(plain), epochs, -1), num_proc=2, data=df, env=env, verbose=1)
    assert accuracy >= baseline - 0.02 and accuracy > 0.85, (accuracy, baseline)
    runs = re.findall(r"launching \d+ rank\(s\) of elastic_fit, run (\w+)", caplog.text)
    assert len(runs) == 3, runs  # the first attempt, the second, the baseline
    assert [d for r in runs for d in work_dirs(r)] == []


@pytest.mark.timeout(420)
def test_an_elastic_fit_grows_back_when_the_host_returns(cluster, tmp_path, caplog):
    """run_elastic starts on 2 ranks while host 1 is down (max_num_proc=4); host 1's worker comes
    back during training. Once its slots have lasted SPARKTRAIN_ELASTIC_GROW_AFTER seconds, the
    ranks end the attempt at their next commit, and the run goes on with 4 ranks from it."""
    import logging

    from helpers import digits, read_ranks
    from pyspark.ml.linalg import Vectors
    from sparktrain.driver.launch import cluster as capacity

    hosts, standalone, session = cluster
    conf = dict(session.sparkContext.getConf().getAll())
    hosts.kill_host(1)
    found = capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors <= 1, 60)
    assert found.executors == 1, found
    (x, y), _ = digits()
    df = session.createDataFrame([(Vectors.dense(x[i]), int(y[i])) for i in range(len(y))], ["features", "label"])
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "SPARKTRAIN_ELASTIC_GROW_AFTER": "3",
           "TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    caplog.set_level(logging.INFO, logger="sparktrain")
    thread, _ = when_running(tmp_path, PER_HOST, lambda: standalone.start_worker(1))
    try:
        sparktrain.run_elastic(elastic_fit, args=(str(tmp_path), 300, 1, HOSTS * PER_HOST), num_proc=PER_HOST,
                               min_num_proc=PER_HOST,
                               max_num_proc=HOSTS * PER_HOST, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(tmp_path))
        assert sorted(ranks) == [0, 1, 2, 3] and all(ranks[r]["size"] == 4 for r in ranks), ranks
        assert len({ranks[r]["digest"] for r in ranks}) == 1
        began = {ranks[r]["began"][0] for r in ranks}
        assert len(began) == 1 and 0 < began.pop() < 300, ranks  # resumed from the commit where it grew
        assert all(ranks[r]["sizes"] == [4] for r in ranks)
        lines = [r.getMessage() for r in caplog.records if "continuing with 4 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and "the cluster has slots for 4 rank(s)" in lines[0], lines
    finally:
        thread.join(120)
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)


@pytest.mark.timeout(180)
def test_a_stall_across_hosts_is_reported_with_the_late_ranks_stack(cluster, tmp_path):
    """stall_warning=10: rank 3, on the second host, waits in user code before an allreduce the
    other three are in. The driver's report names rank 3 and its host, shows its stack down to
    the user's line, and the run goes on once the late rank is let go."""
    from test_stalls import _late_line, one_stall_report

    hosts, _, _ = cluster
    n = HOSTS * PER_HOST
    report, seconds = one_stall_report(str(tmp_path), n - 1, num_proc=n, stall_warning=10, timeout=150)
    head = re.search(rf"stall: ranks 0 \((\S+)\), 1 \(\S+\), 2 \(\S+\) have waited \d+ s in allreduce #2 "
                     rf"\(float32\[8,3\], sum\); rank {n - 1} has not arrived", report)
    late = re.search(rf"rank {n - 1} \((\S+)\) is after allreduce #1", report)
    assert head and late, report
    assert late.group(1) in hosts.ips and late.group(1) != head.group(1), report  # ranks are numbered by host
    assert f"line {_late_line()} in late_rank" in report, report
    fault_time("stall report across hosts, stall_warning=10 s", 20, seconds)
    print(f"stall report {seconds:.1f} s after the stall began")


@pytest.mark.timeout(300)
def test_a_decommissioned_worker_shrinks_an_elastic_fit_at_a_step(cluster, tmp_path, caplog):
    """spark.decommission.enabled: host 1's worker is told to leave (SIGPWR) in epoch 1 of a
    4-rank run_elastic fit. Spark stops counting its slots; the driver leaves the resize marker;
    the ranks commit at the end of the step in which rank 0 saw it and end the attempt without a
    failure; the run goes on with host 0's 2 ranks from that mid-epoch commit. (The worker is told
    after batch 5, and the ranks hold at batch 10 until the marker is down, so that it lands
    inside the epoch whatever the timing.)"""
    from helpers import digits, read_ranks
    from pyspark.ml.linalg import Vectors
    from sparktrain.driver.launch import cluster as capacity

    hosts, standalone, session = cluster
    conf = dict(session.sparkContext.getConf().getAll())
    (x, y), _ = digits()
    df = session.createDataFrame([(Vectors.dense(x[i]), int(y[i])) for i in range(len(y))], ["features", "label"])
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "TF_CPP_MIN_LOG_LEVEL": "2",
           "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    caplog.set_level(logging.INFO, logger="sparktrain")
    n = HOSTS * PER_HOST
    told: list[float] = []
    thread, _ = when_running(tmp_path, n, lambda: (told.append(time.time()), standalone.decommission(1)))
    try:
        sparktrain.run_elastic(elastic_fit, args=(str(tmp_path), 3, 1, None, 2, True), num_proc=n, min_num_proc=PER_HOST,
                               max_num_proc=n, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(tmp_path))
        assert sorted(ranks) == [0, 1] and all(ranks[r]["size"] == PER_HOST for r in ranks), ranks
        assert len({ranks[r]["digest"] for r in ranks}) == 1
        assert all(ranks[r]["sizes"] == [PER_HOST] for r in ranks)  # one reset, with the new size
        resumed = {(ranks[r]["began"][0], ranks[r]["resumed_at"][0]) for r in ranks}
        assert len(resumed) == 1, ranks
        epoch, batch = resumed.pop()
        assert epoch == 1 and batch > 5, ranks  # committed at a step after the notice, inside the epoch
        lines = [r.getMessage() for r in caplog.records if "continuing with 2 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and f"host {hosts.ips[1]} is being decommissioned" in lines[0], lines
        assert f"from the last commit, at epoch {epoch}, batch {batch};" in lines[0], lines
        marker = glob.glob(homes.Home(str(tmp_path / "elastic"), "*").resize_marker(1))
        seconds = os.path.getmtime(marker[0]) - told[0]
        fault_time("decommission notice (SIGPWR) to the resize marker", 10, seconds)
        print(f"resize marker {seconds:.1f} s after the worker was told to leave")
        assert not [r for r in caplog.records if "was lost" in r.getMessage()]  # no rank failed
    finally:
        thread.join(60)
        standalone.start_worker(1)
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.slots(False) >= n, 120)
