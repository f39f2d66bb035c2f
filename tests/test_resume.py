"""A named run across jobs: spark-submit jobs on a local Spark, the first killed with SIGKILL in
epoch 3 of 6, the second resuming from its last commit, the third returning the recorded result;
and, in this process, a second driver on a live run refused, and run_id's bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import sparktrain
from helpers import wait_for_file, wait_pids_gone
from sparktrain.storage import home as homes, lease as leases

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

JOB = textwrap.dedent("""
    import json, os, sys, time
    from pyspark.sql import SparkSession
    import sparktrain

    mode, run_id, url, out = sys.argv[1:5]
    spark = SparkSession.builder.appName("resume-" + mode).getOrCreate()
    with open(os.path.join(out, f"driver-{mode}.pid"), "w") as f:
        f.write(str(os.getpid()))

    def train(out, job, kill_in_epoch):
        import os, threading, time
        import numpy as np
        import keras
        import sparktrain.keras as hvd

        hvd.init()
        r, n = hvd.rank(), hvd.size()
        with open(os.path.join(out, f"rank-{job}-{r}.pid"), "w") as f:
            f.write(str(os.getpid()))
        keras.utils.set_random_seed(7)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(240, 8)).astype("float32")
        y = (x.sum(axis=1) > 0).astype("int32")
        x, y = x[r::n], y[r::n]
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                      loss="sparse_categorical_crossentropy")
        state = hvd.elastic.KerasState(model, epoch=0, batch=0)

        class Mark(keras.callbacks.Callback):
            first = None

            def on_epoch_begin(self, epoch, logs=None):
                if r == 0:
                    with open(os.path.join(out, f"epochs-{job}"), "a") as f:
                        f.write(f"{epoch}\\n")
                if epoch == kill_in_epoch:
                    if r == 0:
                        with open(os.path.join(out, "in-epoch"), "w") as f:
                            f.write(str(epoch))
                    threading.Event().wait(300)  # until the driver is killed

            def on_train_batch_end(self, batch, logs=None):
                if Mark.first is None and r == 0:
                    Mark.first = time.time()
                    with open(os.path.join(out, f"first-step-{job}"), "w") as f:
                        f.write(repr(Mark.first))

        @hvd.elastic.run
        def fit(state):
            model.fit(x, y, batch_size=20, epochs=6, initial_epoch=state.epoch, shuffle=False, verbose=0,
                      callbacks=[hvd.elastic.UpdateEpochStateCallback(state),
                                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10**6), Mark()])
            return [w.tolist() for w in model.get_weights()] if r == 0 else None

        return fit(state)

    env = {"SPARKTRAIN_ELASTIC_URL": url, "SPARKTRAIN_LEASE_TIMEOUT": "4", "TF_CPP_MIN_LOG_LEVEL": "2"}
    jobs = [("ref-" + run_id, "ref", -1)] if mode == "first" else []
    jobs.append((run_id, mode, 3 if mode == "first" else -1))
    for name, job, kill in jobs:
        called = time.time()
        with open(os.path.join(out, f"called-{job}"), "w") as f:
            f.write(repr(called))
        weights = sparktrain.run(train, args=(out, job, kill), num_proc=2, run_id=name, env=env)
        with open(os.path.join(out, f"weights-{job}.json"), "w") as f:
            json.dump(weights, f)
""")


def _spark_submit() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")


def _submit(tmp_path, mode: str, url: str, out: str) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    log = open(tmp_path / f"job-{mode}.log", "w")
    return subprocess.Popen([_spark_submit(), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                             str(script), mode, "victim", url, out], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=tmp_path)


def _finish(tmp_path, proc: subprocess.Popen, mode: str) -> str:
    proc.wait(timeout=240)
    text = (tmp_path / f"job-{mode}.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _read(out: str, name: str) -> str:
    with open(os.path.join(out, name)) as f:
        return f.read()


def _ours(pid: int, job: subprocess.Popen) -> psutil.Process:
    """The process ``pid``, proven to be a descendant of ``job`` (the spark-submit this test started)."""
    proc = psutil.Process(pid)
    assert job.pid in {p.pid for p in proc.parents()}, f"{pid} is not under spark-submit {job.pid}"
    return proc


@pytest.mark.slow  # four spark-submit jobs: run by hand, bash tests/run slow
def test_a_killed_job_resumes_in_a_new_job_and_a_finished_run_returns_at_once(tmp_path):
    import numpy as np

    url, out = str(tmp_path / "runs"), str(tmp_path / "out")
    os.makedirs(out)
    first = _submit(tmp_path, "first", url, out)
    wait_for_file(os.path.join(out, "in-epoch"), timeout=240)
    driver = _ours(int(_read(out, "driver-first.pid")), first)
    ranks = [int(_read(out, f"rank-first-{r}.pid")) for r in (0, 1)]
    driver.kill()  # SIGKILL
    first.wait(timeout=60)
    assert wait_pids_gone(ranks, timeout=60) == []  # no rank of the killed job lives on
    home = homes.Home(url, "victim")
    assert home.last_commit()["epoch"] == 3 and home.result() == (False, None)
    assert home.state() in ("running", "failed")
    assert not [n for n in os.listdir(home.url) if ".partial-" in n]  # nothing half-written
    # The killed driver's lease expires on its own (4 s here); the next job takes it over.
    deadline = time.monotonic() + 30
    while leases.live(home.lease_record()):
        assert time.monotonic() < deadline, home.lease_record()
        time.sleep(0.2)  # the lease's expiry is a wall-clock time: nothing to wait on but it

    second = _finish(tmp_path, _submit(tmp_path, "second", url, out), "second")
    assert "expired; this driver takes it over" in second and "resumes from its last commit (epoch 3" in second
    assert _read(out, "epochs-second").split() == ["3", "4", "5"]  # its first epoch is not 0
    resumed = [np.array(w) for w in json.loads(_read(out, "weights-second.json"))]
    reference = [np.array(w) for w in json.loads(_read(out, "weights-ref.json"))]
    for got, want in zip(resumed, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert home.state() == "finished"

    third = _finish(tmp_path, _submit(tmp_path, "third", url, out), "third")
    assert "finished before; returning its recorded result, launching no rank" in third
    assert not os.path.exists(os.path.join(out, "epochs-third"))  # no rank started
    assert json.loads(_read(out, "weights-third.json")) == json.loads(_read(out, "weights-second.json"))
    # The figures: from the call to the first step, for a fresh run and for the resumed one.
    fresh = float(_read(out, "first-step-ref")) - float(_read(out, "called-ref"))
    again = float(_read(out, "first-step-second")) - float(_read(out, "called-second"))
    print(f"first step after the call: fresh run {fresh:.1f} s, resumed run {again:.1f} s")


def waits(flag: str) -> str:
    import os
    import threading

    open(flag + ".started", "w").close()
    done = threading.Event()
    while not os.path.exists(flag):
        done.wait(0.05)
    return "done"


def test_a_second_driver_on_a_live_run_is_refused_naming_the_first(tmp_path):
    url, flag = str(tmp_path / "runs"), str(tmp_path / "flag")
    env = {"SPARKTRAIN_ELASTIC_URL": url}
    results = []
    first = threading.Thread(target=lambda: results.append(
        sparktrain.run(waits, args=(flag,), num_proc=-1, run_id="busy", env=env, verbose=0)))
    first.start()
    try:
        wait_for_file(flag + ".started", timeout=60)
        with pytest.raises(sparktrain.errors.RunInUseError) as refused:
            sparktrain.run(waits, args=(flag,), num_proc=-1, run_id="busy", env=env, verbose=0)
        assert refused.value.holder["pid"] == os.getpid()
        assert f"pid {os.getpid()}" in str(refused.value) and "started" in str(refused.value)
    finally:
        open(flag, "w").close()
        first.join(timeout=60)
    assert results == ["done"]
    assert homes.Home(url, "busy").state() == "finished"


def test_a_driver_that_loses_its_lease_stops_its_run(tmp_path):
    """Another driver took the lease over (this one was thought dead): at its next renewal, this
    driver stops its run, naming the lease, and its ranks go."""
    from sparktrain.storage import conditional

    url, flag = str(tmp_path / "runs"), str(tmp_path / "flag")
    env = {"SPARKTRAIN_ELASTIC_URL": url, "SPARKTRAIN_LEASE_TIMEOUT": "3"}  # renewed every second
    errors = []

    def run():
        try:
            sparktrain.run(waits, args=(flag,), num_proc=-1, run_id="taken", env=env, verbose=0)
        except sparktrain.SparkTrainError as e:
            errors.append(e)

    first = threading.Thread(target=run)
    first.start()
    try:
        wait_for_file(flag + ".started", timeout=60)
        home = homes.Home(url, "taken")
        record = dict(home.lease_record(), token="another-driver", pid=1, host="elsewhere")
        target = f"{home.url}/{homes.LEASE}"
        data, version = conditional.read(target, None)
        assert conditional.replace(target, json.dumps(record).encode(), version, None)  # the other driver's
        first.join(timeout=60)
    finally:
        open(flag, "w").close()
        first.join(timeout=60)
    assert not first.is_alive() and len(errors) == 1, errors
    assert isinstance(errors[0], sparktrain.errors.RunCancelledError)
    assert "lost the run's lease (another driver holds it now" in str(errors[0]) and "elsewhere" in str(errors[0])


def test_run_id_needs_an_elastic_url_and_a_good_name(monkeypatch):
    monkeypatch.delenv("SPARKTRAIN_ELASTIC_URL", raising=False)
    with pytest.raises(sparktrain.InvalidArgumentError, match="run_id='nightly'.*elastic_url setting"):
        sparktrain.run(len, args=("x",), num_proc=-1, run_id="nightly")
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"run_id='a/b'.*letters, digits"):
        sparktrain.run(len, args=("x",), num_proc=-1, run_id="a/b", env={"SPARKTRAIN_ELASTIC_URL": "/tmp/x"})


def backed_up(out, job):
    import os

    import numpy as np

    import sparktrain.keras as hvd
    import sparktrain.tensorflow
    from sparktrain.keras.front import LINE, keras

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(r + 10 * job)  # each job and rank starts from other weights
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    epochs = []

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            if job == 1 and epoch == 1:
                sparktrain.tensorflow.barrier()  # rank 0 has written epoch 1's backup
                raise RuntimeError("the job's cluster went away")

    backup = hvd.callbacks.BackupAndRestore()
    model.fit(x[r::n], y[r::n], batch_size=10, epochs=4, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), backup, Crash()])
    with open(os.path.join(out, f"backup-{job}-{r}"), "w") as f:
        f.write(f"{LINE} {backup.restored_epoch} {' '.join(map(str, epochs))}")
    return [w.tolist() for w in model.get_weights()]


@pytest.mark.parametrize("line", ["keras", pytest.param("tf_keras", marks=pytest.mark.keras2)])
def test_backup_and_restore_resumes_fit_in_a_new_job_from_the_runs_home(tmp_path, line):
    url, out = str(tmp_path / "runs"), str(tmp_path)
    env = {"SPARKTRAIN_ELASTIC_URL": url, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_USE_LEGACY_KERAS": "1" if line == "tf_keras" else "0"}
    with pytest.raises(sparktrain.RankFailedError, match="went away"):
        sparktrain.run(backed_up, args=(out, 1), num_proc=-2, run_id="keras-only", env=env, verbose=0)
    home = homes.Home(url, "keras-only")
    assert home.failure() is not None and home.result() == (False, None)
    assert sorted(os.listdir(os.path.join(home.url, "backup"))) == ["backup.pkl", "backup.pkl.sparktrain.json"]
    weights = sparktrain.run(backed_up, args=(out, 2), num_proc=-2, run_id="keras-only", env=env, verbose=0)
    for r in (0, 1):  # every rank read the backup of epoch 1 and went on from epoch 2
        assert _read(out, f"backup-2-{r}") == f"{line} 2 2 3"
    assert home.result() == (True, weights)
    assert os.listdir(os.path.join(home.url, "backup")) == []  # deleted at fit's end, as Keras does
