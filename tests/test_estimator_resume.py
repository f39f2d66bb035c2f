"""KerasEstimator's ``run_id`` on a real local[2] Spark with 2 real ranks: a fit whose rank 1 fails
in epoch 2 of 4, then a fit with the same ``run_id`` that starts at epoch 2 (from the backup in the
run's home, ``<elastic_url>/<run_id>/``) and ends with the weights of a fit never interrupted; a
third fit on that live run refused, naming the driver; a fourth that returns the recorded model
without starting a rank; a ``run_id`` without an ``elastic_url`` is Horovod's (the run's folder in the
store), and a bad one is refused before launch."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import sparktrain
from conftest import module_spark
import helpers
from helpers import wait_for_file
from sparktrain.storage import home as homes

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[2]")

#: Epochs of every fit, and the one rank 1 fails in (the first fit's).
EPOCHS, FAIL_IN = 4, 2


def _marker(outdir: str, job: str, fail_in: int | None = None, hold: bool = False):
    """A callback that notes each epoch rank 0 begins in ``epochs-<job>``; with ``fail_in``, rank 1
    raises as that epoch begins (once rank 0 has backed up the epoch before); with ``hold``, rank 0
    waits in its first epoch until ``go`` exists, having written ``holding``."""
    import keras

    class Mark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            import sparktrain

            rank = sparktrain.rank()
            if rank == 0:
                with open(os.path.join(outdir, f"epochs-{job}"), "a") as f:
                    f.write(f"{epoch}\n")
            if epoch == fail_in:
                import sparktrain.tensorflow

                sparktrain.tensorflow.barrier()  # rank 0 is past epoch fail_in - 1's end, its backup written
                if rank == 1:
                    raise RuntimeError(f"rank 1 lost in epoch {epoch}")
            if hold and rank == 0 and not os.path.exists(os.path.join(outdir, "holding")):
                open(os.path.join(outdir, "holding"), "w").close()
                done, go = threading.Event(), os.path.join(outdir, "go")
                for _ in range(2400):  # at most 120 s
                    if os.path.exists(go):
                        break
                    done.wait(0.05)
                else:
                    raise TimeoutError(f"{go} did not appear within 120 s")

    return Mark()


def _frame(spark):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 2))
    rows = [(float(a), float(b), float(2 * a - b + 0.5)) for a, b in x]
    return spark.createDataFrame(rows, "x0 double, x1 double, y double")


def _estimator(tmp_path, run_id, callbacks, elastic=True):
    import keras

    from sparktrain.ml import KerasEstimator

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    if elastic:
        env["SPARKTRAIN_ELASTIC_URL"] = str(tmp_path / "runs")
    return KerasEstimator(model=model, optimizer=keras.optimizers.Adam(0.05), loss="mse", feature_cols=["x0", "x1"],
                          label_cols=["y"], batch_size=4, epochs=EPOCHS, shuffle=False, random_seed=3, num_proc=2,
                          store=f"file://{tmp_path}/store", verbose=0, env=env, run_id=run_id, callbacks=callbacks)


def _epochs(outdir, job) -> list[int]:
    with open(os.path.join(outdir, f"epochs-{job}")) as f:
        return [int(e) for e in f.read().split()]


@pytest.mark.slow  # four fits: run by hand, bash tests/run slow
def test_a_failed_fit_resumes_from_its_backup_in_a_new_fit_and_a_finished_one_returns_its_model(spark, tmp_path):
    df, out = _frame(spark), str(tmp_path)
    reference = _estimator(tmp_path, "never-stopped", [_marker(out, "ref")]).fit(df)
    assert _epochs(out, "ref") == [0, 1, 2, 3]

    with pytest.raises(sparktrain.RankFailedError, match="rank 1 lost in epoch 2"):
        _estimator(tmp_path, "victim", [_marker(out, "first", fail_in=FAIL_IN)]).fit(df)
    home = homes.Home(str(tmp_path / "runs"), "victim")
    assert home.result() == (False, None) and "rank 1 lost" in home.failure()["why"]
    assert home.state() == "failed"
    assert helpers.committed_alone(home.backup_url())

    # The second fit resumes; while it runs, another fit on the same run_id is refused, naming this driver.
    resumed = []
    second = threading.Thread(target=lambda: resumed.append(
        _estimator(tmp_path, "victim", [_marker(out, "second", hold=True)]).fit(df)))
    second.start()
    try:
        wait_for_file(os.path.join(out, "holding"), timeout=180)
        with pytest.raises(sparktrain.errors.RunInUseError) as refused:
            _estimator(tmp_path, "victim", [_marker(out, "refused")]).fit(df)
        assert refused.value.holder["pid"] == os.getpid() and f"pid {os.getpid()}" in str(refused.value)
    finally:
        open(os.path.join(out, "go"), "w").close()
        second.join(timeout=240)
    assert not second.is_alive() and len(resumed) == 1
    assert not os.path.exists(os.path.join(out, "epochs-refused"))
    assert _epochs(out, "second") == list(range(FAIL_IN, EPOCHS))  # the first epoch it trained is the failed one
    fitted = resumed[0]
    assert home.state() == "finished" and os.listdir(os.path.join(home.url, "backup")) == []
    for got, want in zip(fitted.getModel().get_weights(), reference.getModel().get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    gap = max(float(np.max(np.abs(g - w))) for g, w in
              zip(fitted.getModel().get_weights(), reference.getModel().get_weights()))
    print(f"resumed fit against the uninterrupted one: largest weight difference {gap:.2g}")
    history = fitted.getHistory()
    assert len(history["loss"]) == EPOCHS  # the epochs of the failed fit, from their checkpoints, and its own
    np.testing.assert_allclose(history["loss"], reference.getHistory()["loss"], rtol=1e-5, atol=1e-6)

    # A finished run: the recorded model and history, no rank started.
    again = _estimator(tmp_path, "victim", [_marker(out, "third")]).fit(df)
    assert not os.path.exists(os.path.join(out, "epochs-third"))
    assert again.getModelUrl() == fitted.getModelUrl() and again.getHistory() == history
    assert again.getRunId() == "victim"
    for got, want in zip(again.getModel().get_weights(), fitted.getModel().get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_run_id_without_an_elastic_url_names_the_store_folder_as_in_horovod_and_a_bad_one_is_refused(
        spark, tmp_path, monkeypatch):
    monkeypatch.delenv("SPARKTRAIN_ELASTIC_URL", raising=False)
    df = _frame(spark)
    # Without the elastic_url setting, run_id is Horovod's: the run's folder in the store, not a named run.
    spec, _, _ = _estimator(tmp_path, "nightly", [], elastic=False)._prepare(df)
    assert not spec.named and spec.run_url.endswith("/nightly")
    spec, _, _ = _estimator(tmp_path, "nightly", [])._prepare(df)
    assert spec.named
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"run_id='a/b'.*letters, digits"):
        _estimator(tmp_path, "a/b", []).fit(df)
    assert not (tmp_path / "runs").exists()
