"""A named run in this process: a second driver on a live run refused, a driver that lost its
lease stopping its run, run_id's bad input, and the Keras-only path (BackupAndRestore) resuming a
fit in a new call. The killed and resumed spark-submit jobs are tests/test_resume_jobs.py."""
from __future__ import annotations

import json
import os
import threading

import pytest

import sparktrain
import helpers
from helpers import wait_for_file
from sparktrain.storage import home as homes

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

def _read(out: str, name: str) -> str:
    with open(os.path.join(out, name)) as f:
        return f.read()


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


def commits_with_the_runs_options(expected):
    from sparktrain import context

    # No credentials in the rank's environment: its commits and reads use run()'s storage_options.
    assert not any(k.startswith(("AWS_", "AZURE_STORAGE")) for k in os.environ), sorted(os.environ)
    if context.rank() != 0:  # every rank holds them (and imports no TensorFlow here)
        from sparktrain.storage import rank as rank_storage

        assert rank_storage.options() == expected, rank_storage.options()
        return None
    from sparktrain.tensorflow.elastic import ObjectState

    state = ObjectState(bcast_object=lambda o: o, epoch=0)
    if context.size() == 1:  # the job after: resumes from the last commit
        return state._restore_committed(), state.epoch
    for epoch in (1, 2):
        state.epoch = epoch
        state.commit()
    raise RuntimeError("the job's cluster went away")


@pytest.mark.parametrize("scheme", ["s3", "abfs"])
def test_the_ranks_commit_to_the_runs_home_with_runs_storage_options(request, tmp_path, monkeypatch, scheme):
    """run(..., storage_options=) reaches every rank's commits and reads: the ranks' environment
    has no credentials (nor the emulator's address), so the environment's would fail. A job of 2
    ranks commits and fails; the next job of the run resumes from its commit."""
    from storage_servers import fresh_place

    for name in [k for k in os.environ if k.startswith(("AWS_", "AZURE_STORAGE"))]:
        monkeypatch.delenv(name)
    url, options = fresh_place(request, scheme, tmp_path, "runs")
    kwargs = dict(args=(options,), run_id="creds", env={"SPARKTRAIN_ELASTIC_URL": url}, storage_options=options,
                  verbose=0)
    with pytest.raises(sparktrain.RankFailedError, match="cluster went away"):
        sparktrain.run(commits_with_the_runs_options, num_proc=-2, **kwargs)
    home = homes.Home(url, "creds", options)
    assert home.last_commit()["epoch"] == 2 and home.state() == "failed"
    assert sparktrain.run(commits_with_the_runs_options, num_proc=-1, **kwargs) == (True, 2)
    assert home.state() == "finished"


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
    assert helpers.committed_alone(home.backup_url())
    weights = sparktrain.run(backed_up, args=(out, 2), num_proc=-2, run_id="keras-only", env=env, verbose=0)
    for r in (0, 1):  # every rank read the backup of epoch 1 and went on from epoch 2
        assert _read(out, f"backup-2-{r}") == f"{line} 2 2 3"
    assert home.result() == (True, weights)
    assert os.listdir(os.path.join(home.url, "backup")) == []  # deleted at fit's end, as Keras does
