"""run(..., max_attempts=N) on a real local[3] Spark: a failed attempt re-runs the whole gang, ranks
see their attempt number, retries are logged, and a Keras run resumes from its latest checkpoint
on Azurite instead of starting over. The retry policy itself (what is retried, how attempts are
counted in the error, timeouts) is tested without Spark in tests/test_supervision.py.
"""
from __future__ import annotations

import logging

import pytest

import sparktrain
from helpers import digits, read_ranks, record_rank, weights_digest
from conftest import module_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


spark = module_spark("local[3]")


def flaky(outdir):
    import sparktrain

    attempt = sparktrain.attempt()
    record_rank(outdir, tag=f"-attempt{attempt}", attempt=attempt)
    if attempt == 1 and sparktrain.rank() == 1:
        raise RuntimeError("rank 1 fails on the first attempt")
    return attempt


def test_a_failed_attempt_reruns_the_whole_gang_and_says_so(spark, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="sparktrain")
    monkeypatch.setenv("SPARKTRAIN_MAX_ATTEMPTS", "2")  # the environment-variable form of max_attempts
    assert sparktrain.run(flaky, args=(str(tmp_path),), num_proc=3) == 2
    first, second = read_ranks(str(tmp_path), "-attempt1"), read_ranks(str(tmp_path), "-attempt2")
    assert sorted(second) == [0, 1, 2] and 1 in first  # every rank ran again, not just the failed one
    assert not {r["pid"] for r in first.values()} & {r["pid"] for r in second.values()}
    assert {r["env"]["SPARKTRAIN_ATTEMPT"] for r in second.values()} == {"2"}
    assert len({r["env"]["SPARKTRAIN_RUN_ID"] for r in [*first.values(), *second.values()]}) == 1
    assert "attempt 1 of 2 failed: 1 rank failed; root cause: rank 1" in caplog.text
    assert "succeeded on attempt 2 of 2, after 1 failed attempt(s)" in caplog.text


def fit_resuming(prefix, options, epochs, outdir):
    import keras

    import sparktrain
    import sparktrain.keras as hvd

    hvd.init()
    (x, y), _ = digits(hvd.rank(), hvd.size())
    model, initial_epoch = hvd.restore(prefix, options)
    restored = weights_digest(model.get_weights()) if model is not None else None
    if model is None:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.003)),
                      loss="sparse_categorical_crossentropy")

    class CrashOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if sparktrain.attempt() == 1 and hvd.rank() == 1 and self.epoch == 2 and batch == 3:
                raise RuntimeError("rank 1 crashes in the third epoch")

        def on_epoch_end(self, epoch, logs=None):  # the weights each epoch's checkpoint holds
            record_rank(outdir, tag=f"-attempt{sparktrain.attempt()}-epoch{epoch + 1}",
                        weights=weights_digest(model.get_weights()))

    history = model.fit(x, y, batch_size=32, epochs=epochs, initial_epoch=initial_epoch, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), CrashOnce(),
                                   hvd.callbacks.RemoteCheckpoint(prefix + "/epoch-{epoch:02d}.keras",
                                                                  storage_options=options)])
    return {"attempt": sparktrain.attempt(), "initial_epoch": initial_epoch, "restored": restored,
            "epochs_run": len(history.history["loss"]), "optimizer": type(model.optimizer).__name__,
            "distributed": getattr(model.optimizer, "_sparktrain_distributed", False)}


def test_a_retried_keras_run_resumes_from_its_latest_checkpoint_on_azurite(spark, azurite, caplog, tmp_path):
    import uuid

    from sparktrain import storage

    caplog.set_level(logging.INFO, logger="sparktrain")
    options = azurite.options()
    fs, _ = storage.filesystem("abfs://x", options)
    container = f"retries-{uuid.uuid4().hex[:8]}"
    fs.mkdir(container)
    prefix = f"abfs://{container}/run"
    result = sparktrain.run(fit_resuming, args=(prefix, options, 4, str(tmp_path)), num_proc=2, max_attempts=2,
                            env={"TF_CPP_MIN_LOG_LEVEL": "3"}, output_ranks=[])
    # The second attempt continued after the two epochs the first one committed, from the weights
    # saved at the end of the second, with a distributed optimizer again.
    assert (result["attempt"], result["initial_epoch"], result["epochs_run"]) == (2, 2, 2)
    assert result["restored"] == read_ranks(str(tmp_path), "-attempt1-epoch2")[0]["weights"]
    assert (result["optimizer"], result["distributed"]) == ("Adam", True)
    names = [u.rsplit("/", 1)[-1] for u in storage.list_checkpoints(prefix, options)]
    assert names == ["epoch-01.keras", "epoch-02.keras", "epoch-03.keras", "epoch-04.keras"]
    assert storage.read_manifest(f"{prefix}/epoch-02.keras", options)["metadata"]["epoch"] == 2
    assert storage.latest_checkpoint(prefix, options).endswith("epoch-04.keras")
    assert "rank 1 crashes in the third epoch" in caplog.text
    assert "succeeded on attempt 2 of 2" in caplog.text
