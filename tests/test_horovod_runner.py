"""``sparktrain.HorovodRunner``, sparkdl's runner: bad arguments refused in the constructor; real runs
in local mode (``np < 0``) and on a real ``local[2]`` Spark (``np > 0``); and a HorovodRunner
notebook cell written for Keras 2 that trains on tf_keras with only its imports changed (the Keras 2
tier's)."""
from __future__ import annotations

import os
import re

import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks, record_rank, weights_digest

# The Horovod users' tier (-m keras2): HorovodRunner is their notebooks' entry point.
pytestmark = [pytest.mark.timeout(120), pytest.mark.keras2]

spark = module_spark("local[2]")


@pytest.mark.parametrize("kwargs, match", [
    ({"np": 0}, r"np must not be 0, got 0: pass np=N \(N > 0\) for N ranks .* np=-N for N processes on the driver"),
    ({"np": 2.0}, r"np must be an int, got 2\.0 \(float\): np=N runs N ranks"),
    ({"np": "2"}, r"np must be an int, got '2' \(str\)"),
    ({"np": True}, r"np must be an int, got True \(bool\)"),
    ({"np": None}, r"np must be an int, got None \(NoneType\)"),
    ({"np": 2, "driver_log_verbosity": "verbose"},
     r"driver_log_verbosity must be 'all' \(every rank's output in the cell\) or 'log_callback_only' "
     r"\(rank 0's\), got 'verbose'"),
    ({"np": -2, "driver_log_verbosity": None}, r"driver_log_verbosity must be .*, got None"),
])
def test_bad_arguments_are_refused_in_the_constructor_with_the_value(kwargs, match):
    with pytest.raises(sparktrain.InvalidArgumentError, match=match):
        sparktrain.HorovodRunner(**kwargs)  # the constructor: nothing can have started


def test_np_and_driver_log_verbosity_are_keyword_only_and_main_must_be_callable():
    with pytest.raises(TypeError, match="positional"):
        sparktrain.HorovodRunner(2)  # as sparkdl's: HorovodRunner(np=2)
    with pytest.raises(TypeError, match="np"):
        sparktrain.HorovodRunner()
    hr = sparktrain.HorovodRunner(np=-2)
    assert (hr.num_processor, hr.driver_log_verbosity) == (-2, "log_callback_only")  # sparkdl's default
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"needs the training function first, a callable, "
                                                              r"got 'train' \(str\): hr\.run\(main, \*\*kwargs\)"):
        hr.run("train", lr=0.1)


def greet(outdir, scale, word="hi"):
    import sparktrain

    info = record_rank(outdir, scale=scale, word=word)
    print(f"rank {info['rank']} of {info['size']} says {word}")
    return scale * 10 + sparktrain.rank()


def test_negative_np_runs_that_many_processes_on_the_driver(tmp_path, capsys):
    """sparkdl's local mode: every rank's output in the cell even under the default verbosity."""
    value = sparktrain.HorovodRunner(np=-2).run(greet, outdir=str(tmp_path), scale=4, word="hello")
    assert value == 40  # rank 0's
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1]
    assert {(r["size"], r["scale"], r["word"]) for r in ranks.values()} == {(2, 4, "hello")}
    # Processes on this machine (local mode's loopback address), each a process of its own.
    assert {r["env"]["MASTER_ADDR"] for r in ranks.values()} == {"127.0.0.1"}
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    lines = sorted(line for line in capsys.readouterr().out.splitlines() if "says" in line)
    assert lines == ["[0]<stdout>:rank 0 of 2 says hello", "[1]<stdout>:rank 1 of 2 says hello"]


def fail_on_rank_1(outdir):
    import sparktrain

    record_rank(outdir)
    print(f"rank {sparktrain.rank()} reading its shard")
    if sparktrain.rank() == 1:
        raise ValueError("shard 1 is empty")
    return "done"


@pytest.mark.spark
def test_positive_np_runs_a_barrier_stage_showing_the_output_that_driver_log_verbosity_picks(spark, tmp_path, capsys):
    value = sparktrain.HorovodRunner(np=2).run(greet, outdir=str(tmp_path), scale=3)
    assert value == 30
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1] and {r["word"] for r in ranks.values()} == {"hi"}  # main's own default
    assert {r["env"]["SPARKTRAIN_SIZE"] for r in ranks.values()} == {"2"}
    # "log_callback_only" (the default): rank 0's output alone.
    assert [line for line in capsys.readouterr().out.splitlines() if "says" in line] == [
        "[0]<stdout>:rank 0 of 2 says hi"]

    # A failed rank's traceback and last lines come with the error, though its output was not shown.
    (tmp_path / "f").mkdir()
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(fail_on_rank_1,
                                                                                     outdir=str(tmp_path / "f"))
    root = e.value.root_cause
    assert (root.rank, root.exc_type.rsplit(".", 1)[-1], root.message) == (1, "ValueError", "shard 1 is empty")
    assert "rank 1 reading its shard" in root.output_tail and "fail_on_rank_1" in root.traceback
    assert "[1]<stdout>" not in capsys.readouterr().out

    # "all": every rank's.
    assert sparktrain.HorovodRunner(np=2, driver_log_verbosity="all").run(greet, outdir=str(tmp_path), scale=5) == 50
    assert sorted(line for line in capsys.readouterr().out.splitlines() if "says" in line) == [
        "[0]<stdout>:rank 0 of 2 says hi", "[1]<stdout>:rank 1 of 2 says hi"]


def train_hvd(learning_rate, epochs, data_path, checkpoint_dir, outdir):
    """A HorovodRunner notebook cell written for Keras 2 (tf.keras before TensorFlow 2.16): only its
    two imports differ (``from sparkdl import HorovodRunner``, ``import horovod.tensorflow.keras as hvd``)."""
    import os

    import numpy as np
    import tensorflow as tf

    import sparktrain.keras as hvd

    hvd.init()
    data = np.load(data_path)
    x_train, y_train = data["x"][hvd.rank()::hvd.size()], data["y"][hvd.rank()::hvd.size()]

    model = tf.keras.Sequential([
        tf.keras.layers.Dense(32, activation="relu", input_shape=(64,)),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    # Keras 2's legacy optimizer still takes lr=; scale it by the number of ranks.
    optimizer = tf.keras.optimizers.legacy.Adadelta(lr=learning_rate * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if hvd.rank() == 0:  # one writer
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "checkpoint-{epoch}.h5")))
    history = model.fit(x_train, y_train, batch_size=32, epochs=epochs, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    accuracy = model.evaluate(data["x_test"], data["y_test"], verbose=0)[1]
    print(f"rank {hvd.rank()}: test accuracy {accuracy:.3f}")

    # For the test: what each rank saw and ended with.
    record_rank(outdir, loss=history.history["loss"], accuracy=float(accuracy),
                weights=[w.tolist() for w in model.get_weights()], digest=weights_digest(model.get_weights()),
                model_module=type(model).__module__, tf_keras=tf.keras.__name__,
                optimizer_classes=[c.__name__ for c in type(optimizer).__mro__],
                learning_rate=float(tf.keras.backend.get_value(optimizer.learning_rate)))
    return history.history["loss"]


@pytest.mark.spark
@pytest.mark.keras2
@pytest.mark.timeout(300)
def test_a_keras_2_horovodrunner_cell_trains_on_tf_keras(spark, tmp_path, capsys, monkeypatch):
    import h5py
    import numpy as np

    from helpers import digits

    (x, y), (x_test, y_test) = digits()
    np.savez(tmp_path / "digits.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ranks").mkdir()
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")  # as Databricks tells Keras 2 users to

    hr = sparktrain.HorovodRunner(np=2, driver_log_verbosity="all")
    losses = hr.run(train_hvd, learning_rate=1.0, epochs=3, data_path=str(tmp_path / "digits.npz"),
                    checkpoint_dir=str(tmp_path / "ckpt"), outdir=str(tmp_path / "ranks"))

    ranks = read_ranks(str(tmp_path / "ranks"))
    assert sorted(ranks) == [0, 1]
    assert losses == ranks[0]["loss"] and len(losses) == 3  # rank 0's value
    for r, got in ranks.items():
        # tf_keras all through: the model, tf.keras, the legacy optimizer under the wrapper, its lr= honoured.
        assert got["model_module"].startswith("tf_keras.") and got["tf_keras"].startswith("tf_keras"), (r, got)
        assert "Adadelta" in got["optimizer_classes"], (r, got["optimizer_classes"])
        assert got["learning_rate"] == pytest.approx(2.0), r  # 1.0 x 2 ranks
        assert got["loss"][-1] < got["loss"][0], (r, got["loss"])
        assert got["accuracy"] > 0.5, (r, got["accuracy"])
    # Broadcast at the start and averaged gradients since: the same weights on both ranks.
    assert ranks[0]["digest"] == ranks[1]["digest"]

    # Rank 0 alone checkpointed: one file an epoch, the last holding the weights both ranks ended with.
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"checkpoint-{e}.h5" for e in (1, 2, 3)]
    with h5py.File(tmp_path / "ckpt" / "checkpoint-3.h5", "r") as f:
        saved = []
        f["model_weights"].visititems(lambda name, obj: saved.append(np.asarray(obj)) if isinstance(obj, h5py.Dataset)
                                      else None)
    final = [np.asarray(w, dtype=np.float32) for w in ranks[0]["weights"]]
    assert sorted(w.tobytes() for w in saved) == sorted(w.tobytes() for w in final)

    # driver_log_verbosity="all": both ranks' lines in the cell, Keras' epoch lines from rank 0 alone.
    out = capsys.readouterr().out
    for r in (0, 1):
        assert re.search(rf"^\[{r}\]<stdout>:rank {r}: test accuracy 0\.\d+$", out, re.M), out[-3000:]
    assert len(re.findall(r"^\[0\]<stdout>:Epoch \d/3$", out, re.M)) == 3, out[-3000:]
    assert not re.search(r"^\[1\]<stdout>:Epoch", out, re.M)
