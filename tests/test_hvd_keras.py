"""Horovod's ``horovod.tensorflow.keras`` surface in sparktrain.keras, checked on 3 real ranks (CPU).

One run of 3 TensorFlow processes makes every check (a rank costs seconds to start); the test
functions read what each rank recorded.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import sparktrain
from helpers import digits, read_ranks, record_rank, same_on_every_rank, weights_digest

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


def _dense_model(keras, seed, hidden=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,))]
    if hidden:
        layers.append(keras.layers.Dense(hidden, activation="relu", name="shared"))
    layers.append(keras.layers.Dense(10, activation="softmax", name="head"))
    return keras.Sequential(layers)


def _fit(model, opt, x, y, batch, epochs=1, callbacks=(), **kwargs):
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks),
                     **kwargs)


def accumulation_and_compression(got, hvd, keras, x, y, x_test, y_test):
    """backward_passes_per_step against a batch twice the size; fp16 against no compression."""
    import numpy as np

    B, k = 20, 6
    xs, ys = x[:2 * B * k], y[:2 * B * k]
    runs = {}
    for label, opt, batch in [
        ("passes2_avg", hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                 average_aggregated_gradients=True), B),
        # Horovod's default sums the passes: the same as the average at twice the rate.
        ("passes2_sum", hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2), B),
        ("double_batch", hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), 2 * B),
        ("predivide", hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), gradient_predivide_factor=3.0), 2 * B),
        ("groups", hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2), 2 * B),
    ]:
        model = _dense_model(keras, 0, hidden=8)
        _fit(model, opt, xs, ys, batch)
        runs[label] = model.get_weights()
        got[f"iterations_{label}"] = int(opt.iterations.numpy())
        got[f"variables_{label}"] = len(opt.variables)
    # What this Keras counts in iterations when it accumulates: updates (1 per 2 passes), or, as
    # Keras 3.2 does, passes (2).
    plain, v = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), keras.Variable(1.0)
    for _ in range(2):
        plain.apply([keras.ops.ones(())], [v])
    got["keras_iterations_per_2_passes"] = int(plain.iterations.numpy())
    got["passes2_avg_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                      zip(runs["passes2_avg"], runs["double_batch"]))
    got["passes2_sum_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                      zip(runs["passes2_sum"], runs["double_batch"]))
    got["predivide_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                    zip(runs["predivide"], runs["double_batch"]))
    got["groups_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(runs["groups"], runs["double_batch"]))
    got["double_batch_moved"] = float(np.max(np.abs(runs["double_batch"][0] - _dense_model(keras, 0, 8).get_weights()[0])))
    got["passes2_digest"] = weights_digest(runs["passes2_avg"])
    # An infinite gradient in one accumulation cycle stays out of the next: its accumulator starts again from 0.
    import tensorflow as tf

    w = keras.Variable(1.0, name="w")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    seen = []
    for g in (float("inf"), float("inf"), 1.0, 1.0):
        if len(seen) == 2:
            w.assign(1.0)
        opt.apply_gradients([(tf.constant(g), w)])
        seen.append(float(w.numpy()))
    got["inf_cycle_then_finite"] = seen

    for label, compression in [("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)]:
        model = _dense_model(keras, 0, hidden=16)
        _fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.2), compression=compression), x, y, 25, epochs=5)
        got[f"accuracy_{label}"] = float(model.evaluate(x_test, y_test, verbose=0)[1])
        got[f"digest_{label}"] = weights_digest(model.get_weights())


def sparse_gradients(got, hvd, keras, rank):
    """An Embedding's IndexedSlices gradient: gathered (default) or densified (sparse_as_dense)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(rank)
    x = rng.integers(0, 30, size=(60, 3)).astype("int32")  # each rank touches different rows
    y = rng.normal(size=(60, 1)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(30, 4, name="emb"),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    probe = model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((probe(x[:10]) - y[:10]) ** 2)
    got["embedding_gradient_type"] = type(tape.gradient(loss, probe.get_layer("emb").embeddings)).__name__
    weights = {}
    for label, dense in [("sparse", False), ("dense", True)]:
        m = model()
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=dense), loss="mse")
        m.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
        weights[label] = m.get_layer("emb").get_weights()[0]
    got["embedding_max_diff"] = float(np.max(np.abs(weights["sparse"] - weights["dense"])))
    got["embedding_moved"] = float(np.max(np.abs(weights["dense"] - model().get_layer("emb").get_weights()[0])))
    got["embedding_digest"] = weights_digest([weights["sparse"]])


def local_layers(got, hvd, keras, rank, x, y):
    """PartialDistributedOptimizer and register_local_var keep a layer's weights each rank's own."""
    model = _dense_model(keras, rank, hidden=16)  # different initial weights on every rank
    head = model.get_layer("head")
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])
    _fit(model, opt, x[:300], y[:300], 20, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got["partial_shared"] = weights_digest(model.get_layer("shared").get_weights())
    got["partial_local"] = weights_digest(head.get_weights())

    model = _dense_model(keras, rank, hidden=16)
    head = model.get_layer("head")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt.register_local_var(head.kernel)
    _fit(model, opt, x[:300], y[:300], 20,
         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[head.kernel])])
    got["registered_shared"] = weights_digest(model.get_layer("shared").get_weights() + [head.bias.numpy()])
    got["registered_local"] = weights_digest([head.kernel.numpy()])


def sync_batch_norm(got, hvd, keras, rank):
    """SyncBatchNormalization's training moments are those of the concatenated batch."""
    import numpy as np

    rng = np.random.default_rng(10 + rank)
    x = (rng.normal(size=(rank + 2, 3)) * (rank + 1) + rank).astype("float32")  # batches of 2, 3 and 4 rows
    layer = hvd.SyncBatchNormalization(momentum=0.0, epsilon=1e-3)
    out = layer(x, training=True)
    everything = hvd.allgather(x).numpy()
    got["sbn_out"] = np.asarray(out).tolist()
    got["sbn_moving"] = [layer.moving_mean.numpy().tolist(), layer.moving_variance.numpy().tolist()]
    got["sbn_all"] = everything.tolist()

    # Trained inside model.fit: the moments' gradient crosses ranks too.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8), hvd.SyncBatchNormalization(),
                              keras.layers.Dense(10, activation="softmax")])
    (xd, yd), _ = digits(rank, hvd.size(), n_train=300)
    history = _fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), xd, yd, 20, epochs=2)
    got["sbn_fit_digest"] = weights_digest(model.get_weights())
    got["sbn_fit_loss"] = history.history["loss"]


def schedules_and_best(got, hvd, keras, rank, outdir, x, y, x_test, y_test):
    """LearningRateScheduleCallback (staircase, per batch, momentum correction) and BestModelCheckpoint."""
    import numpy as np

    seen = {"lr": [], "velocity": [], "velocity_end": []}

    def velocity(optimizer):
        momentums = getattr(optimizer, "momentums", None)
        return float(np.sum(np.abs(momentums[0].numpy()))) if momentums else 0.0

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen["lr"].append(float(self.model.optimizer.learning_rate.numpy()))
            seen["velocity"].append(velocity(self.model.optimizer))

        def on_train_batch_end(self, batch, logs=None):
            seen["velocity_end"].append(velocity(self.model.optimizer))

    x5, y5 = x[:100], y[:100]  # 5 batches of 20 per epoch
    model = _dense_model(keras, 0)
    history = _fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), x5, y5, 20, epochs=4,
                   callbacks=[hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1, end_epoch=3),
                              Record()])
    got["staircase_lr"] = seen["lr"]
    got["staircase_velocity"] = seen["velocity"]
    got["staircase_velocity_end"] = seen["velocity_end"]
    got["staircase_logged"] = history.history["lr"]

    seen["lr"], seen["velocity"] = [], []
    model = _dense_model(keras, 0)
    _fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), x5, y5, 20, epochs=2,
         callbacks=[hvd.callbacks.LearningRateScheduleCallback(0.2, lambda epoch: epoch, start_epoch=1,
                                                               staircase=False), Record()])
    got["smooth_lr"] = seen["lr"]

    epoch_digests = []

    class Digest(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_digests.append(weights_digest(self.model.get_weights()))

    model = _dense_model(keras, 0, hidden=16)
    path = os.path.join(outdir, f"best-rank{rank}.keras")
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", mode="max", filepath=path)
    history = _fit(model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), x[:300], y[:300], 20, epochs=3,
                   validation_data=(x_test, y_test),
                   callbacks=[hvd.callbacks.MetricAverageCallback(), best, Digest()])
    got["best_val_losses"] = history.history["val_loss"]
    got["best_epoch_digests"] = epoch_digests
    if os.path.exists(path):
        got["best_saved_digest"] = weights_digest(keras.models.load_model(path).get_weights())


def save_and_load(got, hvd, keras, outdir, x, y):
    """load_model brings the optimizer back distributed, with backward_passes_per_step and compression."""
    import sparktrain.tensorflow

    model = _dense_model(keras, 0, hidden=8)
    _fit(model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2), x[:200], y[:200],
         20)
    path = os.path.join(outdir, "saved.keras")
    hvd.save_model(model, path)
    sparktrain.tensorflow.barrier()  # rank 0 has written it
    loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
    opt = loaded.optimizer
    got["loaded"] = [type(opt).__name__, getattr(type(opt), "_sparktrain_distributed", False),
                     opt.gradient_accumulation_steps, int(opt.iterations.numpy()),
                     weights_digest(loaded.get_weights()) == weights_digest(model.get_weights())]
    loaded.fit(x[200:400], y[200:400], batch_size=20, epochs=1, shuffle=False, verbose=0)
    got["loaded_trained"] = weights_digest(loaded.get_weights())
    got["loaded_iterations"] = int(opt.iterations.numpy())


def loss_scale(got, hvd, keras, rank):
    """Mixed precision: one rank's gradients overflow, and every rank skips the step and lowers the scale."""
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="mixed_float16"),
                              keras.layers.Dense(1, dtype="float32")])
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)))
    model.compile(optimizer=opt, loss="mse")
    before = weights_digest(model.get_weights())
    x = np.full((4, 4), 3000.0 if rank == 1 else 0.01, np.float32)  # rank 1's float16 gradients overflow
    model.fit(x, np.zeros((4, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    got["loss_scale"] = [type(opt).__name__, type(opt.inner_optimizer).__name__,
                         weights_digest(model.get_weights()) == before, float(opt.dynamic_scale.numpy())]
    model.fit(np.full((4, 4), 0.01, np.float32), np.ones((4, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    got["loss_scale_after"] = [weights_digest(model.get_weights()) == before,
                               weights_digest(model.get_weights())]

    # The LossScaleOptimizer model.compile adds under a mixed_float16 policy agrees too, once the
    # broadcast callback has seen it.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    before = weights_digest(model.get_weights())
    model.fit(x, np.zeros((4, 1), np.float32), batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got["compile_loss_scale"] = [type(model.optimizer).__name__,
                                 getattr(type(model.optimizer), "_sparktrain_distributed", False),
                                 weights_digest(model.get_weights()) == before,
                                 float(model.optimizer.dynamic_scale.numpy())]


def hvd_keras_checks(outdir):
    import keras

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), (x_test, y_test) = digits(r, n)
    got: dict = {}
    accumulation_and_compression(got, hvd, keras, x, y, x_test, y_test)
    sparse_gradients(got, hvd, keras, r)
    local_layers(got, hvd, keras, r, x, y)
    sync_batch_norm(got, hvd, keras, r)
    schedules_and_best(got, hvd, keras, r, outdir, x, y, x_test, y_test)
    save_and_load(got, hvd, keras, outdir, x, y)
    loss_scale(got, hvd, keras, r)
    # A uint32 variable (Keras 3.2's seed state) comes from the root bit for bit.
    import numpy as np
    import tensorflow as tf

    seed = tf.Variable(np.array([4_000_000_000 + r, r], dtype=np.uint32))
    hvd.broadcast_variables([seed], root_rank=0)
    got["uint32_broadcast"] = [int(v) for v in seed.numpy()]
    # Clipping acts on the reduced gradient: rank 0's 3.0 and the others' 0.0 average to 1.0,
    # clipped to 0.5 (clipping each rank's own first would give 0.5 / 3).
    w = keras.Variable(0.0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0, global_clipnorm=0.5))
    opt.apply([tf.constant(3.0 if r == 0 else 0.0)], [w])
    got["clipped_after_reduction"] = float(w.numpy())
    record_rank(outdir, got=got)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("hvd_keras")
    sparktrain.run(hvd_keras_checks, args=(str(outdir),), num_proc=-3, env=ENV, verbose=0)
    found = read_ranks(str(outdir))
    assert sorted(found) == [0, 1, 2]
    return {r: info["got"] for r, info in found.items()}, outdir


@pytest.mark.timeout(400)
def test_backward_passes_per_step_equals_one_pass_over_twice_the_batch(ranks):
    ranks, _ = ranks
    for got in ranks.values():
        assert got["double_batch_moved"] > 1e-3  # training changed the weights...
        assert got["passes2_avg_max_diff"] < 1e-6, got["passes2_avg_max_diff"]  # ...the same way
        assert got["passes2_sum_max_diff"] < 1e-6, got["passes2_sum_max_diff"]
        assert got["predivide_max_diff"] < 1e-6 and got["groups_max_diff"] < 1e-6
        # Keras counts updates, not passes: 6 updates either way (Keras 3.2-3.4 count the 12 passes).
        per_update = got["keras_iterations_per_2_passes"]
        assert per_update in (1, 2) and got["iterations_double_batch"] == 6
        assert got["iterations_passes2_avg"] == 6 * per_update
        # The optimizer's own variables only: iterations and the rate, and one accumulator per weight
        # (2 layers x kernel and bias) when it accumulates; never the model's.
        assert (got["variables_double_batch"], got["variables_passes2_avg"]) == (2, 6)
    same_on_every_rank(ranks, "passes2_digest")
    for got in ranks.values():  # the first cycle applied inf; the second its own passes, 2 x 1.0, only
        seen = got["inf_cycle_then_finite"]
        assert seen[0] == 1.0 and not np.isfinite(seen[1]) and seen[2] == 1.0, seen
        assert abs(seen[3] - 0.8) < 1e-6, seen


@pytest.mark.timeout(400)
def test_fp16_compression_trains_as_well_as_none(ranks):
    ranks, _ = ranks
    none, fp16 = same_on_every_rank(ranks, "accuracy_none"), same_on_every_rank(ranks, "accuracy_fp16")
    same_on_every_rank(ranks, "digest_fp16")
    assert none > 0.8 and abs(none - fp16) <= 0.01, (none, fp16)
    assert ranks[0]["digest_none"] != ranks[0]["digest_fp16"]  # fp16 really rounded the gradients


@pytest.mark.timeout(400)
def test_sparse_gradients_gathered_equal_sparse_as_dense(ranks):
    ranks, _ = ranks
    for got in ranks.values():
        assert got["embedding_gradient_type"] == "IndexedSlices"
        assert got["embedding_moved"] > 1e-3
        assert got["embedding_max_diff"] < 1e-6, got["embedding_max_diff"]
    same_on_every_rank(ranks, "embedding_digest")


@pytest.mark.timeout(400)
def test_local_layers_differ_across_ranks_and_the_rest_is_identical(ranks):
    ranks, _ = ranks
    for kind in ("partial", "registered"):
        same_on_every_rank(ranks, f"{kind}_shared")
        assert len({got[f"{kind}_local"] for got in ranks.values()}) == 3, kind


@pytest.mark.timeout(400)
def test_sync_batch_norm_uses_the_moments_of_the_global_batch(ranks):
    import numpy as np

    ranks, _ = ranks
    everything = np.array(same_on_every_rank(ranks, "sbn_all"))
    assert everything.shape == (9, 3)
    mean, var = everything.mean(axis=0), everything.var(axis=0)
    reference = (everything - mean) / np.sqrt(var + 1e-3)  # BatchNormalization on the concatenated batch
    start = 0
    for r in range(3):
        out = np.array(ranks[r]["sbn_out"])
        np.testing.assert_allclose(out, reference[start:start + r + 2], rtol=1e-4, atol=1e-5)
        start += r + 2
        moving_mean, moving_var = ranks[r]["sbn_moving"]
        np.testing.assert_allclose(moving_mean, mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(moving_var, var, rtol=1e-4, atol=1e-5)
    same_on_every_rank(ranks, "sbn_fit_digest")
    losses = ranks[0]["sbn_fit_loss"]
    assert losses[1] < losses[0] and all(np.isfinite(losses))


@pytest.mark.timeout(400)
def test_learning_rate_schedule_callback(ranks):
    ranks, _ = ranks
    got = ranks[0]
    lr = got["staircase_lr"]
    # Epoch 0 is before start_epoch (the optimizer's own 0.1); epochs 1 and 2 are 0.4 * 0.5 ** (epoch - 1);
    # epoch 3 is end_epoch, left at the last value.
    assert lr == pytest.approx([0.1] * 5 + [0.4] * 5 + [0.2] * 5 + [0.2] * 5), lr
    assert got["staircase_logged"] == pytest.approx([0.1, 0.4, 0.2, 0.2])
    begin, end = got["staircase_velocity"], got["staircase_velocity_end"]
    # Momentum correction: the momentum buffer follows the rate's change (x4 at epoch 1, x0.5 at epoch 2)
    # and is left alone where the rate stays.
    assert end[4] > 0
    assert begin[5] == pytest.approx(4 * end[4], rel=1e-5)
    assert begin[10] == pytest.approx(0.5 * end[9], rel=1e-5)
    assert begin[6] == pytest.approx(end[5], rel=1e-6) and begin[15] == pytest.approx(end[14], rel=1e-6)
    smooth = got["smooth_lr"]
    assert smooth[:5] == pytest.approx([0.1] * 5)  # before start_epoch
    assert smooth[5:] == pytest.approx([0.2 * (1 + b / 5) for b in range(5)])  # 0.2 * (epoch + batch / steps)


@pytest.mark.timeout(400)
def test_best_model_checkpoint_keeps_the_best_epoch_from_rank_0(ranks):
    ranks, outdir = ranks
    assert os.path.exists(outdir / "best-rank0.keras")
    assert not os.path.exists(outdir / "best-rank1.keras") and not os.path.exists(outdir / "best-rank2.keras")
    got = ranks[0]
    losses = got["best_val_losses"]
    best = max(range(len(losses)), key=lambda e: losses[e])  # mode="max": the worst loss is "best"
    assert best != len(losses) - 1, losses  # so the file is not simply the last epoch
    assert got["best_saved_digest"] == got["best_epoch_digests"][best]
    assert same_on_every_rank(ranks, "best_val_losses") == losses  # averaged by MetricAverageCallback


def test_gradients_are_clipped_after_the_reduction(ranks):
    ranks, _ = ranks
    assert [round(got["clipped_after_reduction"], 6) for got in ranks.values()] == [-0.5] * 3


def test_a_uint32_variable_is_broadcast_bit_for_bit(ranks):
    ranks, _ = ranks
    assert [got["uint32_broadcast"] for got in ranks.values()] == [[4_000_000_000, 0]] * 3


@pytest.mark.timeout(400)
def test_load_model_brings_back_a_distributed_optimizer(ranks):
    ranks, _ = ranks
    # Adam, distributed, accumulating 2 passes, 10 passes = 5 updates so far (Keras 3.2 counts
    # the passes), the saved weights...
    per_update = ranks[0]["keras_iterations_per_2_passes"]
    assert same_on_every_rank(ranks, "loaded") == ["Adam", True, 2, 5 * per_update, True]
    # ...and it trains on, reducing over the ranks: equal weights everywhere.
    same_on_every_rank(ranks, "loaded_trained")
    assert ranks[0]["loaded_iterations"] == 10 * per_update


@pytest.mark.timeout(400)
def test_ranks_skip_an_overflowing_mixed_precision_step_together(ranks):
    ranks, _ = ranks
    # Rank 1 alone overflowed, yet no rank updated, and every rank halved the scale (2 ** 15 -> 2 ** 14)...
    assert same_on_every_rank(ranks, "loss_scale") == ["LossScaleOptimizer", "SGD", True, 2.0 ** 14]
    # ...then a finite step updates everyone alike.
    assert same_on_every_rank(ranks, "loss_scale_after")[0] is False
    assert same_on_every_rank(ranks, "compile_loss_scale") == ["LossScaleOptimizer", True, True, 2.0 ** 14]


@pytest.mark.timeout(120)
def test_bad_arguments_are_refused_with_the_value():
    import keras

    import sparktrain.keras as hvd
    import sparktrain.tensorflow

    sgd = keras.optimizers.SGD(0.1)
    cases = [
        (dict(op=sparktrain.tensorflow.Max), "op must be sparktrain.keras.Average or Sum for gradients, got 'max'"),
        (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor=2.0 needs op=Average"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step must be a whole number of at least 1, got 0"),
        (dict(compression="fp16"), "compression must be Compression.none or Compression.fp16"),
        (dict(groups=[1, 2]), "groups must be a positive number of groups or a list of lists of variables"),
        (dict(process_set=object()), "pass global_process_set or a ProcessSet registered with hvd.add_process_set"),
    ]
    for kwargs, message in cases:
        with pytest.raises(sparktrain.SparkTrainError, match=None) as e:
            hvd.DistributedOptimizer(sgd, **kwargs)
        assert message in str(e.value), (kwargs, str(e.value))
    with pytest.raises(sparktrain.SparkTrainError) as e:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2)
    assert "set either that or backward_passes_per_step=2" in str(e.value)
    with pytest.raises(sparktrain.SparkTrainError) as e:
        hvd.broadcast_global_variables(0)
    assert "BroadcastGlobalVariablesCallback(root_rank)" in str(e.value)
    with pytest.raises(sparktrain.SparkTrainError) as e:
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)
    assert "initial_lr must be a positive number" in str(e.value)
    with pytest.raises(sparktrain.SparkTrainError) as e:
        hvd.PartialDistributedOptimizer(sgd, local_layers=["dense"])
    assert "local_layers must be Keras layers, got str" in str(e.value)
