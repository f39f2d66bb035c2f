"""``sparktrain.run`` over Spark Connect, against two servers: the embedded one that
``SparkSession.builder.remote("local[3]")`` starts, and a Connect server in a process of its own
(its driver is not this process), reached at ``sc://127.0.0.1:PORT``.

The core path, the fault paths and the refusals of the classic tests, over both.
"""
from __future__ import annotations

import _thread
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import sparktrain
from connect_server import ConnectServer, needs_server
from helpers import rank_processes, read_ranks, record_rank, run_marker, wait_for_file, wait_for_ranks, weights_digest

pytest.importorskip("grpc")
pytestmark = [pytest.mark.timeout(300), needs_server]

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


@pytest.fixture(scope="module", params=["embedded", "server"])
def spark(request):
    from pyspark.sql import SparkSession

    saved = dict(os.environ)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *[p for p in saved.get("PYTHONPATH", "").split(os.pathsep) if p]])
    server = None
    if request.param == "embedded":
        session = SparkSession.builder.remote("local[3]").getOrCreate()
    else:
        server = ConnectServer("local[3]")
        session = SparkSession.builder.remote(server.url).getOrCreate()
    session.kind = request.param
    session.server = server
    yield session
    session.stop()
    if server is not None:
        server.stop()
    os.environ.clear()
    os.environ.update(saved)  # the embedded server leaves its token behind


def hello(n):
    import os

    import sparktrain

    print(f"hello from {sparktrain.rank()}")
    return {"rank": sparktrain.rank(), "size": sparktrain.size(), "blob": os.urandom(n)}


def test_a_connect_session_runs_and_returns_rank_zeros_value_in_chunks(spark, caplog):
    from sparktrain.driver.launch import cluster

    assert cluster.is_connect(spark)
    out = io.StringIO()
    with caplog.at_level(logging.INFO, "sparktrain"):
        got = sparktrain.run(hello, args=(3 << 20,), num_proc=3, stdout=out)  # more than one 1 MiB chunk
    assert (got["rank"], got["size"], len(got["blob"])) == (0, 3, 3 << 20)
    assert "over Spark Connect: executors can reach this client at 127.0.0.1; ranks meet through its channel" \
        in caplog.text
    assert sorted(line for line in out.getvalue().splitlines() if "hello" in line) == \
        [f"[{r}]<stdout>:hello from {r}" for r in range(3)]  # live, over the channel


def test_without_a_channel_each_ranks_output_comes_back_with_the_result(spark, monkeypatch, caplog):
    monkeypatch.setenv("SPARKTRAIN_RENDEZVOUS", "barrier")  # as when executors cannot reach this client
    out = io.StringIO()
    assert sparktrain.run(hello, args=(10,), num_proc=3, stdout=out, verbose=0)["rank"] == 0
    assert sorted(line for line in out.getvalue().splitlines() if "hello" in line) == \
        [f"[{r}]<stdout>:hello from {r}" for r in range(3)]


class Watched(io.StringIO):
    """An output stream that sets ``seen`` once ``needle`` was written to it."""

    def __init__(self, needle: str):
        super().__init__()
        self.needle, self.seen = needle, threading.Event()

    def write(self, text: str) -> int:
        n = super().write(text)
        if self.needle in self.getvalue():
            self.seen.set()
        return n


def wait_for_go(outdir):
    import sparktrain

    print(f"rank {sparktrain.rank()} waits")
    if sparktrain.rank() == 0:
        wait_for_file(os.path.join(outdir, "go"), timeout=120)
    print(f"rank {sparktrain.rank()} done")


def test_with_a_log_url_output_streams_through_storage_while_the_ranks_run(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKTRAIN_RENDEZVOUS", "barrier")  # as when executors cannot reach this client
    out = Watched("[0]<stdout>:rank 0 waits")
    go = threading.Thread(target=lambda: out.seen.wait(120) and (tmp_path / "go").touch(), daemon=True)
    go.start()
    sparktrain.run(wait_for_go, args=(str(tmp_path),), num_proc=3, stdout=out, verbose=0,
                   log_url=f"file://{tmp_path}/logs")
    go.join(10)
    assert out.seen.is_set()  # rank 0 was still waiting for "go" when its first line arrived here
    lines = out.getvalue().splitlines()
    assert sorted(lines) == sorted([f"[{r}]<stdout>:rank {r} waits" for r in range(3)]
                                   + [f"[{r}]<stdout>:rank {r} done" for r in range(3)])
    pieces = sorted(os.listdir(next((tmp_path / "logs").iterdir())))
    assert {p.split("-")[1] for p in pieces} == {"0", "1", "2"}  # the run's log stays in storage


def test_a_run_started_from_another_thread_uses_the_connect_session(spark):
    # The active session is per thread; an embedded server's own classic session must not be taken.
    box = {}
    t = threading.Thread(target=lambda: box.update(size=sparktrain.run(lambda: sparktrain.size(), num_proc=3,
                                                                         verbose=0)), daemon=True)
    t.start()
    t.join(240)
    assert box.get("size") == 3


def shard_rows():
    import sparktrain.data

    return list(sparktrain.data.shard().rows_per_rank)


def test_data_feeds_a_dataframe_over_connect(spark):
    assert sorted(sparktrain.run(shard_rows, num_proc=3, data=spark.range(0, 100), verbose=0)) == [33, 33, 34]


def shard_kind_and_rows():
    import sparktrain.data

    s = sparktrain.data.shard()
    return type(s).__name__, list(s.rows_per_rank), sorted(int(i) for i in sparktrain.data.numpy("id")[:s.rows])


def test_a_parquet_scan_over_connect_is_read_by_the_ranks_from_its_files(spark, tmp_path):
    path = str(tmp_path / "table")
    spark.range(0, 90, 1, 3).write.parquet(path)
    kind, rows, ids = sparktrain.run(shard_kind_and_rows, num_proc=3, data=spark.read.parquet(path), verbose=0)
    assert kind == "StreamShard" and sum(rows) == 90 and rows == [30, 30, 30]
    assert ids == list(range(30))  # rank 0: the first file, in file order


def fail_on_one(outdir):
    import time

    import sparktrain

    record_rank(outdir)
    if sparktrain.rank() == 1:
        wait_for_ranks(outdir, 3)
        raise ValueError("rank one gives up")
    time.sleep(120)


@pytest.mark.parametrize("rendezvous", ["auto", "barrier"])
def test_a_rank_that_raises_fails_the_run_with_its_cause_first(spark, tmp_path, monkeypatch, rendezvous):
    monkeypatch.setenv("SPARKTRAIN_RENDEZVOUS", rendezvous)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(fail_on_one, args=(str(tmp_path),), num_proc=3, verbose=0)
    assert e.value.root_cause.rank == 1
    assert "root cause: rank 1 " in str(e.value)
    assert "ValueError: rank one gives up" in str(e.value)
    assert rank_processes(run_marker(read_ranks(str(tmp_path))[0]), timeout=10) == []


def exit_hard(outdir):
    import os
    import time

    import sparktrain

    record_rank(outdir)
    if sparktrain.rank() == 2:
        wait_for_ranks(outdir, 3)
        os._exit(3)
    time.sleep(120)


def test_a_hard_exit_names_the_rank_and_its_code(spark, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(exit_hard, args=(str(tmp_path),), num_proc=3, verbose=0)
    assert (e.value.root_cause.rank, e.value.root_cause.exitcode) == (2, 3)


def hang(outdir):
    import time

    record_rank(outdir)
    time.sleep(600)


def test_a_hang_is_ended_by_the_timeout_and_leaves_no_process(spark, tmp_path):
    with pytest.raises(sparktrain.RunTimeoutError):
        sparktrain.run(hang, args=(str(tmp_path),), num_proc=3, timeout=8, verbose=0)
    assert rank_processes(run_marker(read_ranks(str(tmp_path))[0]), timeout=10) == []
    assert sparktrain.run(lambda: sparktrain.size(), num_proc=3, verbose=0) == 3  # the session is fine


def test_keyboard_interrupt_cancels_the_run_by_its_tag(spark, tmp_path):
    outdir = str(tmp_path)

    def interrupt():
        wait_for_ranks(outdir, 3, timeout=120)
        _thread.interrupt_main()  # what a notebook's stop button does

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sparktrain.run(hang, args=(outdir,), num_proc=3, verbose=0)
    finally:
        t.join(130)
    assert rank_processes(run_marker(read_ranks(outdir)[0]), timeout=10) == []


def test_too_few_slots_are_refused_with_figures_before_launch(spark):
    with pytest.raises(sparktrain.InsufficientResourcesError) as e:
        sparktrain.run(lambda: 0, num_proc=5, verbose=0)
    assert "num_proc=5 needs 5 task slots at once" in str(e.value)
    assert "but the cluster has 3" in str(e.value)
    assert "counted from the session's conf (spark.master=local[3]" in str(e.value)


def test_other_versions_on_the_executors_fail_at_once(spark, monkeypatch):
    from sparktrain.seam import versions

    real = versions.collect()
    monkeypatch.setattr(versions, "collect", lambda: dict(real, cloudpickle="0.0.1"))
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(lambda: 1, num_proc=3, verbose=0)
    assert e.value.root_cause.exc_type == "sparktrain.errors.VersionMismatchError"
    assert f"cloudpickle: driver 0.0.1, this executor {real['cloudpickle']}" in e.value.root_cause.message


def test_an_executors_python_of_another_minor_version_is_refused_before_launch(spark, tmp_path, monkeypatch):
    # As the classic path's version tests do, the client claims other versions; the probe that
    # chooses the rendezvous has reported the executors' Python, once per session.
    from sparktrain.seam import versions
    from sparktrain.driver.launch import connect, views

    real = versions.collect()
    monkeypatch.setattr(versions, "collect", lambda: dict(real, python="3.1.0"))
    marker = tmp_path / "ran"
    with pytest.raises(sparktrain.ClusterConfigError) as e:
        sparktrain.run(lambda: marker.write_text("ran"), num_proc=3, verbose=0)
    message = str(e.value)
    assert f"the executors' Python, {sys.executable} (Python {real['python']}), is another minor version" in message
    assert f"this client runs {sys.executable} (Python 3.1.0)" in message
    assert f"PYSPARK_PYTHON set to a Python 3.1 " in message and f"export PYSPARK_PYTHON={sys.executable}" in message
    assert not marker.exists()  # refused before the run's stage
    assert connect.probe(views.of(spark), connect.client_host(spark)).python == sys.executable


def test_an_executors_python_that_lacks_a_module_is_refused_before_launch(spark, monkeypatch):
    from sparktrain.driver.launch import connect, views

    key = (str(spark.session_id), connect.client_host(spark))
    seen = connect.probe(views.of(spark), key[1])
    monkeypatch.setitem(connect._PROBED, key, connect.Probed(seen.reached, seen.python, seen.version, ("sparktrain",)))
    with pytest.raises(sparktrain.ClusterConfigError) as e:
        sparktrain.run(lambda: 1, num_proc=3, verbose=0)
    assert f"the executors' Python, {sys.executable} (Python {seen.version}), cannot import sparktrain" in str(e.value)


def _digest_callback(outdir):
    import keras

    class Digest(keras.callbacks.Callback):
        """Each rank notes its weights' digest when training ends."""

        def on_train_end(self, logs=None):
            with open(os.path.join(outdir, f"digest-{sparktrain.rank()}"), "w") as f:
                f.write(weights_digest(self.model.get_weights()))

    return Digest()


def test_keras_estimator_fits_and_scores_a_dataframe_over_connect(spark, tmp_path):
    """KerasEstimator's fit (2 ranks, the DistributedOptimizer, the feed) and KerasModel's transform
    (predict_batch_udf), through the Connect session alone."""
    if spark.kind == "embedded":
        pytest.skip("trained once, against the separate server")
    import keras
    import numpy as np

    from sparktrain.ml import KerasEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(900, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("float32")
    # 60% of the training rows have their label flipped and a weight of 0: only sample_weight_col
    # keeps the model from learning the flipped rule.
    noise = (rng.random(900) < 0.6) & (np.arange(900) < 700)
    rows = [(i, x[i].tolist(), float(1 - y[i] if noise[i] else y[i]), 0.0 if noise[i] else 1.0) for i in range(900)]
    df = spark.createDataFrame(rows, "id long, x array<double>, y double, w double")
    keras.utils.set_random_seed(0)
    est = KerasEstimator(
        model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")]),
        optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy", metrics=["accuracy"], feature_cols=["x"],
        label_cols=["y"], sample_weight_col="w", batch_size=32, epochs=5, num_proc=2, random_seed=0,
        store=f"file://{tmp_path}/store",
        callbacks=[_digest_callback(str(tmp_path))], verbose=0, env=ENV)
    model = est.fit(df.filter("id < 700"))
    assert len({open(tmp_path / f"digest-{r}").read() for r in range(2)}) == 1  # the ranks stayed equal
    assert len(model.getHistory()["loss"]) == 5
    scored = model.transform(df.filter("id >= 700").coalesce(1)).select("y", "y__output").collect()
    assert len(scored) == 200 and all(isinstance(r["y__output"], float) for r in scored)
    assert np.mean([(r["y__output"] > 0.5) == (r["y"] > 0.5) for r in scored]) > 0.8


CLIENT_ONLY = textwrap.dedent("""
    import importlib.abc, sys

    class NoClassicSpark(importlib.abc.MetaPathFinder):
        # What a pyspark-client installation lacks: the classic core and Py4J.
        def find_spec(self, name, path=None, target=None):
            if name == "py4j" or name.startswith(("py4j.", "pyspark.core")):
                raise ImportError(f"{name} is not on a Connect-only client")
            return None

    sys.meta_path.insert(0, NoClassicSpark())
    from pyspark.sql import SparkSession
    import sparktrain
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    value = sparktrain.run(lambda: sparktrain.rank() + 41, num_proc=2, verbose=0,
                           data=spark.range(0, 10))
    print("VALUE", value, "PY4J", any(m == "py4j" or m.startswith("py4j.") for m in sys.modules))
""")


def test_a_client_without_py4j_or_pyspark_core_runs(spark):
    if spark.kind == "embedded":
        pytest.skip("the embedded server itself runs on Py4J in this process")
    proc = subprocess.run([sys.executable, "-c", CLIENT_ONLY, spark.server.url], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VALUE 41 PY4J False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_check_reports_a_connect_session(spark):
    from sparktrain.cli import check

    out = io.StringIO()
    code = check.run_check(lambda: (spark, False), num_proc=3, out=out, timeout=120)
    report = out.getvalue()
    assert code == 0, report
    assert "local[3] (through Spark Connect)" in report
    assert "1 (from the conf; a Connect client cannot list them)" in report, report
    assert "3: 1 executor(s) x 3 core(s)" in report, report
    assert "barrier mode: a barrier stage of 3 task(s) ran" in report
    assert "every task reached the client at 127.0.0.1" in report


def test_the_check_command_takes_a_connect_server(spark):
    if spark.kind == "embedded":
        pytest.skip("the command connects to a server by its URL")
    proc = subprocess.run([sys.executable, "-m", "sparktrain", "check", "--remote", spark.server.url],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "capacity: 3 rank(s) fit at once" in proc.stdout, proc.stdout


def fail_first_attempt():
    import sparktrain

    if sparktrain.attempt() == 1 and sparktrain.rank() == 1:
        raise RuntimeError("a transient failure")
    return sparktrain.attempt()


def test_max_attempts_starts_the_gang_again_over_connect(spark):
    assert sparktrain.run(fail_first_attempt, num_proc=3, max_attempts=2, verbose=0) == 2


def hold_a_slot(outdir):
    def hold(batches):
        from helpers import wait_for_file

        open(os.path.join(outdir, "holding"), "w").close()
        try:
            wait_for_file(os.path.join(outdir, "release"), timeout=120)
        except TimeoutError:
            pass
        yield from batches

    return hold


def test_start_timeout_names_the_ranks_that_never_started(spark, tmp_path):
    # One of the three slots is busy with another job of the same session, so the barrier stage
    # cannot start; the start timeout must end the run, name the ranks, and cancel only its own job.
    outdir = str(tmp_path)
    box = {}

    def blocker():
        try:
            box["rows"] = spark.range(0, 1, 1, 1).mapInArrow(hold_a_slot(outdir), "id long").count()
        except Exception as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t = threading.Thread(target=blocker, daemon=True)
    t.start()
    try:
        wait_for_file(os.path.join(outdir, "holding"), timeout=120)
        with pytest.raises(sparktrain.StartTimeoutError, match=r"rank\(s\) \[0, 1, 2\] to start.*start_timeout"):
            sparktrain.run(lambda: 0, num_proc=3, start_timeout=3, verbose=0)
    finally:
        open(os.path.join(outdir, "release"), "w").close()
        t.join(120)
    assert box.get("rows") == 1, box  # the other job was not cancelled with the run
    assert sparktrain.run(lambda: sparktrain.size(), num_proc=3, verbose=0) == 3


API_MODE = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession
    import sparktrain
    from sparktrain.driver.launch import cluster

    spark = SparkSession.builder.master("local[2]").config("spark.api.mode", "connect").getOrCreate()
    print("CONNECT", cluster.is_connect(spark), type(spark).__module__)
    print("VALUE", sparktrain.run(lambda: sparktrain.size() * 10 + sparktrain.rank(), num_proc=2, verbose=0))
    spark.stop()
""")


def test_a_classic_application_switched_to_connect_by_api_mode_runs(spark):
    if spark.kind == "embedded":
        pytest.skip("runs once, while no embedded server holds Connect's default port: pyspark's api mode "
                    "always connects to sc://localhost")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_AUTHENTICATE_TOKEN"}
    proc = subprocess.run([sys.executable, "-c", API_MODE], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "CONNECT True pyspark.sql.connect.session" in proc.stdout, proc.stdout
    assert "VALUE 20" in proc.stdout, proc.stdout


def test_where_the_conf_does_not_say_a_probe_counts_the_slots(spark, monkeypatch, caplog):
    from sparktrain.driver.launch import connect

    # As on a cluster whose conf names no executor count: the slots are found by a probe job.
    monkeypatch.setattr(connect, "capacity", lambda conf: None)
    monkeypatch.setenv("SPARKTRAIN_CAPACITY_WAIT", "3")
    with caplog.at_level(logging.INFO, logger="sparktrain"):
        assert sparktrain.run(lambda: sparktrain.size(), num_proc=3, stdout=io.StringIO()) == 3
    assert "3 tasks ran at once in a probe job" in caplog.text
    with pytest.raises(sparktrain.InsufficientResourcesError) as e:
        sparktrain.run(lambda: 0, num_proc=4, verbose=0)
    assert "num_proc=4 needs 4 task slots at once, but only 3 task(s) of a probe job of 4 ran at once within 3 s" \
        in str(e.value)
    with pytest.raises(sparktrain.InvalidArgumentError, match="num_proc is required over Spark Connect"):
        sparktrain.run(lambda: 0, verbose=0)
    assert sparktrain.run(lambda: sparktrain.size(), num_proc=3, verbose=0) == 3  # the probe left nothing behind


def test_a_study_runs_its_gangs_over_connect(spark):
    optuna = pytest.importorskip("optuna")
    import sparktrain.tune
    import tune_objectives

    study = optuna.create_study()
    with pytest.raises(sparktrain.InvalidArgumentError, match="need 4 task slots at once; the cluster has 3"):
        sparktrain.tune.optimize(study, tune_objectives.where, n_trials=2, concurrent_trials=2, num_proc=2)
    study.enqueue_trial({"x": 0.25})
    sparktrain.tune.optimize(study, tune_objectives.where, n_trials=3, concurrent_trials=3, num_proc=1,
                             stdout=io.StringIO())
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert study.trials[0].params == {"x": 0.25} and study.trials[0].intermediate_values == {0: 0.25}
    assert all(t.value == t.params["x"] for t in study.trials)
