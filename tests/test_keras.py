"""Keras 3 data-parallel training and TensorFlow collectives on 3 real TensorFlow processes (CPU)."""
from __future__ import annotations

import os

import pytest

import sparktrain
from helpers import assert_collectives, digits, read_ranks, record_rank, weights_digest

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)

#: Quiet TensorFlow's C++ logging in the ranks; a short collective timeout so nothing can hang long.
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


def collectives(outdir):
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    got = {}
    for dtype in ("float32", "float64", "int32"):
        t = tf.cast(tf.reshape(tf.range(6), [2, 3]) + r, dtype)
        got[f"sum_{dtype}"] = hvd.allreduce(t, op=hvd.Sum).numpy().tolist()
        got[f"avg_{dtype}"] = hvd.allreduce(t).numpy().tolist()
        got[f"gather_{dtype}"] = hvd.allgather(tf.cast(tf.fill([r + 1, 2], r), dtype)).numpy().tolist()
        got[f"bcast_{dtype}"] = hvd.broadcast(tf.cast(tf.fill([2, 2], r), dtype), root_rank=1).numpy().tolist()

    @tf.function
    def in_graph(x):
        return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, root_rank=2)

    for step in range(3):  # the traced function runs repeatedly with its fixed keys
        s, g, b = in_graph(tf.constant([float(r + step)]))
    got["graph"] = [s.numpy().tolist(), g.numpy().tolist(), b.numpy().tolist()]
    # Collectives inside functions (every training step) must not leave a thread behind each.
    import psutil

    threads_before = psutil.Process().num_threads()
    for step in range(300):
        in_graph(tf.constant([1.0]))
    got["thread_growth"] = psutil.Process().num_threads() - threads_before
    v = tf.Variable(np.full([3], r, np.float32))
    hvd.broadcast_variables([v], root_rank=2)
    got["variable"] = v.numpy().tolist()
    record_rank(outdir, got=got)


def collectives_then_custom_loop(outdir):
    """Three tests' worth of work in one run of 3 ranks: the collectives, a custom loop, then a fit
    with the learning-rate warm-up."""
    collectives(os.path.join(outdir, "collectives"))
    custom_loop(os.path.join(outdir, "loop"), 25)
    warmup_fit(os.path.join(outdir, "warmup"))


@pytest.fixture(scope="module")
def eager_and_loop(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("eager_and_loop")
    for sub in ("collectives", "loop", "warmup"):
        os.makedirs(outdir / sub)
    sparktrain.run(collectives_then_custom_loop, args=(str(outdir),), num_proc=-3, env=ENV, verbose=0)
    return outdir


def test_collectives_eager_and_in_tf_function(eager_and_loop):
    ranks = read_ranks(str(eager_and_loop / "collectives"))
    assert sorted(ranks) == [0, 1, 2]
    assert_collectives(ranks)


def digits_mlp():
    """fit_digits' model: 64 pixels in, 10 classes out."""
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def fit_digits(outdir, epochs, per_rank_batch, lr, seed_by_rank, reference=False):
    import keras

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), (x_test, y_test) = digits(r, n)
    keras.utils.set_random_seed(r if seed_by_rank else 0)
    model = digits_mlp()
    initial = weights_digest(model.get_weights())
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(lr * n))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=per_rank_batch, epochs=epochs, verbose=2 if r == 0 else 0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    one = one_process_fit(epochs, per_rank_batch * n, lr * n) if r == 0 and reference else None
    record_rank(outdir, initial=initial, final=weights_digest(model.get_weights()), accuracy=accuracy,
                history=history.history, optimizer=type(model.optimizer).__name__, one=one)
    return accuracy


def one_process_fit(epochs, batch, lr):
    """The reference: the same model trained by this process alone on all the rows, with the
    global batch and learning rate (no collectives); its test accuracy."""
    import keras

    (x, y), (x_test, y_test) = digits(0, 1)
    keras.utils.set_random_seed(0)
    model = digits_mlp()
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    return float(model.evaluate(x_test, y_test, verbose=0)[1])


def custom_loop(outdir, steps):
    import keras
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), _ = digits(r, n)
    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.5)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvd.broadcast_variables(model.variables, root_rank=0)
    after_broadcast = weights_digest(model.get_weights())

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return hvd.allreduce(loss)

    losses = [float(step(x[i % 10 * 50:(i % 10 + 1) * 50], y[i % 10 * 50:(i % 10 + 1) * 50])) for i in range(steps)]
    record_rank(outdir, after_broadcast=after_broadcast, final=weights_digest(model.get_weights()), losses=losses)


def test_custom_loop_with_distributed_gradient_tape(eager_and_loop):
    ranks = read_ranks(str(eager_and_loop / "loop"))
    assert len({info["after_broadcast"] for info in ranks.values()}) == 1
    assert len({info["final"] for info in ranks.values()}) == 1
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0] * 0.6, losses


def legacy_strategy_fit(outdir):
    import tensorflow as tf
    import tf_keras

    import sparktrain.tensorflow as hvd

    strategy = hvd.strategy()
    (x, y), (x_test, y_test) = digits()  # the strategy shards the dataset itself
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(96).with_options(options)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", input_shape=(64,)),
                                     tf_keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=tf_keras.optimizers.Adam(0.003), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    model.fit(data, epochs=6, verbose=0)
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    record_rank(outdir, accuracy=accuracy, mwms=isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
                workers=strategy.num_replicas_in_sync)
    return accuracy


@pytest.mark.keras2  # Keras 2 code under MultiWorkerMirroredStrategy: the Horovod users' tier
def test_tf_keras_strategy_path_trains(tmp_path):
    accuracy = sparktrain.run(legacy_strategy_fit, args=(str(tmp_path),), num_proc=-2,
                              env={**ENV, "TF_USE_LEGACY_KERAS": "1"}, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1]
    assert {(info["mwms"], info["workers"]) for info in ranks.values()} == {(True, 2)}
    assert accuracy > 0.8


def uneven_fit():
    import keras

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), _ = digits(r, n)
    if r == 1:
        x, y = x[:300], y[:300]  # 10 batches of 30 where rank 0 has 25
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=30, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])


def test_uneven_data_is_a_clear_error_not_a_hang():
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(uneven_fit, num_proc=-2, env=ENV, verbose=0)
    msg = e.value.root_cause.message
    assert "different numbers of steps per epoch (rank 0: 25, rank 1: 10)" in msg, msg
    assert "steps_per_epoch=10" in msg


def test_readme_demo_trains_a_cnn_on_3_ranks(tmp_path):
    """`sparktrain demo`, as README runs it, in a fresh process with its own embedded Spark."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "sparktrain", "demo", "--epochs", "6"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:Epoch ")]
    assert len(epochs) == 6
    assert not any(line.startswith(("[1]", "[2]")) for line in proc.stdout.splitlines())  # rank 0 only
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("trained on 3 ranks") and "test accuracy 0.9" in final, final
    assert (tmp_path / "sparktrain-demo-model.keras").stat().st_size > 10_000
    assert "started an embedded local[3] session" in proc.stderr
    rank_lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[0]<")]
    assert rank_lines
    # TensorFlow's C++ start-up lines are hidden by default: the ranks', and the driver's own when it
    # imports TensorFlow to evaluate. So is pyspark's pandas-version warning, which its SparkContext
    # gives as the embedded session starts.
    startup = [line for line in (proc.stdout + proc.stderr).splitlines()
               if any(w in line for w in ("absl::InitializeLog", "oneDNN", "cudart", "cuInit", "cpu_feature_guard",
                                          "To enable the following instructions", "fully support pandas",
                                          "Unable to register", "already registered", "TF-TRT",
                                          "Could not find cuda drivers"))]
    assert startup == [], startup


def warmup_fit(outdir):
    import keras

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), _ = digits(r, n, n_train=200 * n)  # 200 per rank: 10 batches of 20
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=20, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), Record()])
    record_rank(outdir, lrs=seen)


def test_learning_rate_warmup_ramps_from_lr_over_size(eager_and_loop):
    n = 3
    lrs = read_ranks(str(eager_and_loop / "warmup"))[0]["lrs"]
    assert len(lrs) == 30
    assert lrs[0] == pytest.approx(0.4 / n)  # initial_lr / size at the first batch
    assert all(a < b for a, b in zip(lrs[:20], lrs[1:20]))  # rising through the 2 warm-up epochs
    # At batch 19 of 20, 1.9 of the 2 epochs: initial_lr / size * (1 + 1.9 * (size - 1) / 2).
    assert lrs[19] == pytest.approx(0.4 / n * (1 + 19 / 20 * (n - 1)), rel=1e-5)
    assert lrs[20:] == pytest.approx([0.4] * 10)  # then the full rate
