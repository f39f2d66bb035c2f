"""Horovod's elastic API on sparktrain: state committed on one attempt, restored on the next."""
from __future__ import annotations

import os

import pytest

import sparktrain
from helpers import digits, read_ranks, record_rank, weights_digest
from sparktrain.storage import home as homes

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


def crash_then_resume(outdir):
    """Commits after every epoch through the Keras callbacks; rank 1 dies on attempt 1 after epoch 2."""
    import keras

    import sparktrain.keras as hvd
    import sparktrain.tensorflow

    hvd.init()
    r, n, attempt = hvd.rank(), hvd.size(), sparktrain.attempt()
    (x, y), _ = digits(r, n, n_train=300)
    keras.utils.set_random_seed(r + 10 * attempt)  # every attempt and rank starts from other weights
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0, note="fresh")
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])
    committed = {}

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            committed[state.epoch] = [weights_digest(model.get_weights()), int(model.optimizer.iterations.numpy())]
            record_rank(outdir, tag=f"-commits{attempt}", committed=committed)
            if attempt == 1 and state.epoch == 2:
                sparktrain.tensorflow.barrier()  # rank 0 has written epoch 2's commit before rank 1 dies
                if r == 1:
                    raise RuntimeError("rank 1 lost its executor")

    @hvd.elastic.run
    def train(state):
        start = {"epoch": state.epoch, "batch": state.batch, "note": state.note, "resets": list(resets),
                 "weights": weights_digest(model.get_weights()),
                 "iterations": int(model.optimizer.iterations.numpy())}
        record_rank(outdir, tag=f"-start{attempt}", start=start)
        state.note = f"attempt {attempt}"
        model.fit(x, y, batch_size=20, epochs=4, initial_epoch=state.epoch, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=1000), Crash()])
        return state.epoch

    return train(state)


@pytest.mark.timeout(300)
def test_a_retried_attempt_resumes_from_the_committed_epoch_and_weights(tmp_path):
    url = str(tmp_path / "elastic")
    epochs = sparktrain.run(crash_then_resume, args=(str(tmp_path),), num_proc=-2, max_attempts=2, verbose=0,
                            env={**ENV, "SPARKTRAIN_ELASTIC_URL": url})
    assert epochs == 4
    first = read_ranks(str(tmp_path), "-start1")
    second = read_ranks(str(tmp_path), "-start2")
    assert sorted(first) == sorted(second) == [0, 1]
    assert {info["start"]["epoch"] for info in first.values()} == {0}
    committed = read_ranks(str(tmp_path), "-commits1")[0]["committed"]
    assert sorted(committed) == ["1", "2"]  # the crash came after epoch 2's commit
    for info in second.values():
        start = info["start"]
        # Epoch, weights and the optimizer's state as committed at epoch 2 on attempt 1, on every rank,
        # although attempt 2 seeded other weights; attributes come back too.
        assert (start["epoch"], start["batch"]) == (2, 0), start
        assert [start["weights"], start["iterations"]] == committed["2"], (start, committed["2"])
        assert start["note"] == "attempt 1" and start["resets"] == [2]
    final = read_ranks(str(tmp_path), "-commits2")
    assert sorted(final[0]["committed"]) == ["3", "4"]  # only the epochs left were trained
    assert len({info["committed"]["4"][0] for info in final.values()}) == 1
    run_dirs = os.listdir(url)
    assert len(run_dirs) == 1 and os.path.exists(homes.Home(url, run_dirs[0]).state_url())


def in_memory(outdir):
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    import sparktrain.tensorflow.elastic  # noqa: F401 - hvd.elastic

    hvd.init()
    v = tf.Variable([float(hvd.rank())] * 2)
    state = hvd.elastic.TensorFlowState([v], epoch=0)

    @hvd.elastic.run
    def train(state):
        synced = v.numpy().tolist()  # rank 0's values everywhere
        state.epoch = 3
        v.assign([7.0, 7.0])
        state.commit()
        state.epoch = 5
        v.assign([9.0, 9.0])
        state.restore()  # back to the last commit, as in Horovod
        return synced, state.epoch, v.numpy().tolist()

    synced, epoch, values = train(state)
    record_rank(outdir, synced=synced, epoch=epoch, values=values)


@pytest.mark.timeout(300)
def test_without_a_url_commits_stay_in_memory_and_several_attempts_are_refused(tmp_path):
    sparktrain.run(in_memory, args=(str(tmp_path),), num_proc=-2, env=ENV, verbose=0)
    ranks = read_ranks(str(tmp_path))
    for info in ranks.values():
        assert info["synced"] == [0.0, 0.0]
        assert (info["epoch"], info["values"]) == (3, [7.0, 7.0])
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(in_memory, args=(str(tmp_path),), num_proc=-1, max_attempts=2, env=ENV, verbose=0)
    message = e.value.root_cause.message
    for needed in ("max_attempts=2", "SPARKTRAIN_ELASTIC_URL", "spark.sparktrain.elasticUrl", "max_attempts=1",
                   "sparktrain.keras.restore()"):
        assert needed in message, message


def test_the_elastic_url_reaches_the_ranks_from_the_spark_conf():
    from helpers import handed_env

    from sparktrain import settings

    conf = {"spark.sparktrain.elasticUrl": "abfss://ckpt@acct.dfs.core.windows.net/elastic"}
    assert handed_env({}, conf)["SPARKTRAIN_ELASTIC_URL"] == "abfss://ckpt@acct.dfs.core.windows.net/elastic"
    # run(env=...) wins over the conf, and "none" turns it off.
    assert handed_env({"SPARKTRAIN_ELASTIC_URL": "/mnt/elastic"}, conf)["SPARKTRAIN_ELASTIC_URL"] == "/mnt/elastic"
    assert settings.resolve("elastic_url", environ={"SPARKTRAIN_ELASTIC_URL": "none"}) == ""
    with pytest.raises(sparktrain.InvalidArgumentError, match="elastic_url must be an fsspec URL"):
        settings.resolve("elastic_url", 5)
