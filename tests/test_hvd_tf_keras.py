"""Horovod's ``horovod.tensorflow.keras`` on tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``), checked on
2 real ranks (CPU).

One run of 2 TensorFlow processes makes every check; the test functions read what each rank
recorded. ``TF_USE_LEGACY_KERAS=1`` is given in ``env=``, so ``tf.keras`` is tf_keras in the ranks
and ``sparktrain.keras`` serves it; the driver (this test process) keeps Keras 3.
"""
from __future__ import annotations

import os

import pytest

import sparktrain
from helpers import digits, read_ranks, record_rank, same_on_every_rank, weights_digest

pytest.importorskip("tf_keras")
pytestmark = pytest.mark.keras2

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60", "TF_USE_LEGACY_KERAS": "1"}


def _model(tf, seed, hidden=8, batch_norm=False):
    tf.keras.utils.set_random_seed(seed)
    layers = [tf.keras.Input((64,)), tf.keras.layers.Dense(hidden, activation="relu", name="shared")]
    layers.append(tf.keras.layers.Dense(10, activation="softmax", name="head"))
    return tf.keras.Sequential(layers)


def _fit(model, opt, x, y, batch, epochs=1, callbacks=()):
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


def fit_and_callbacks(got, hvd, tf, r, outdir, x, y, x_test, y_test):
    """Both optimizer families train in fit from each rank's own initial weights to the same weights."""
    for label, opt in [("adam", tf.keras.optimizers.Adam(0.01 * hvd.size())),
                       ("legacy_adadelta", tf.keras.optimizers.legacy.Adadelta(learning_rate=1.0))]:
        model = _model(tf, seed=r)  # different on every rank until the broadcast
        best = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=os.path.join(outdir, f"best-{label}.h5"))
        dist = hvd.DistributedOptimizer(opt)
        history = _fit(model, dist, x, y, 32, epochs=3, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), best])
        got[f"{label}_class"] = [type(dist).__name__, type(dist).__module__.split(".")[0],
                                 getattr(type(dist), "_sparktrain_distributed", False)]
        got[f"{label}_digest"] = weights_digest(model.get_weights())
        got[f"{label}_loss"] = [float(v) for v in history.history["loss"]]
        got[f"{label}_accuracy"] = float(model.evaluate(x_test, y_test, verbose=0)[1])
    got["best_files"] = sorted(n for n in os.listdir(outdir) if n.startswith("best-"))


def reduction_rules(got, hvd, tf, r):
    """The reduced gradient, its clipping, Sum, and the two optimizer families, step by step."""
    inf = float("inf")
    for label, sgd in [("new", tf.keras.optimizers.SGD), ("legacy", tf.keras.optimizers.legacy.SGD)]:
        w = tf.Variable(1.0)
        hvd.DistributedOptimizer(sgd(1.0)).minimize(lambda: w * float(r + 1), [w])  # grads 1 and 2: mean 1.5
        got[f"{label}_average_step"] = float(w.numpy())
        w = tf.Variable(1.0)
        hvd.DistributedOptimizer(sgd(1.0), op=hvd.Sum).minimize(lambda: w * float(r + 1), [w])
        got[f"{label}_sum_step"] = float(w.numpy())
        # Clipping acts on the reduced gradient: 3.0 and 0.0 average to 1.5, clipped to 0.5 (clipping
        # each rank's own first would give 0.25).
        w = tf.Variable(1.0)
        hvd.DistributedOptimizer(sgd(1.0, global_clipnorm=0.5)).minimize(lambda: w * (3.0 if r == 0 else 0.0), [w])
        got[f"{label}_clipped_step"] = float(w.numpy())
        # Mixed precision's loss scale: an overflow on rank 0 alone is skipped by every rank.
        w = tf.Variable(1.0)
        lso = hvd.DistributedOptimizer(tf.keras.mixed_precision.LossScaleOptimizer(sgd(0.1)))
        lso.minimize(lambda: w * (inf if r == 0 else 1.0), [w])
        got[f"{label}_overflow"] = [float(w.numpy()), float(lso.loss_scale.numpy()),
                                    getattr(type(lso.inner_optimizer), "_sparktrain_distributed", False)]
        lso.minimize(lambda: w * 1.0, [w])
        got[f"{label}_after_overflow"] = float(w.numpy())
    # What Horovod's Keras 2 wrapper gave every optimizer, and its own tests call: _compute_gradients
    # (reduced once) and _agg_helper.counter (passes since the last update; None without aggregation).
    w = tf.Variable(1.0)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        loss = w * float(r + 1)
    got["private_compute"] = [float(opt._compute_gradients(loss, [w], tape=tape)[0][0].numpy()),
                              opt._agg_helper is None]
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    counters = []
    for _ in range(3):
        opt.minimize(lambda: w * 1.0, [w])
        counters.append(int(opt._agg_helper.counter.numpy()))
    got["agg_counter"] = counters


def accumulation(got, hvd, tf, x, y):
    """backward_passes_per_step against a batch twice the size."""
    import numpy as np

    B, k = 20, 6
    xs, ys = x[:2 * B * k], y[:2 * B * k]
    runs = {}
    for label, opt, batch in [
        ("passes2_avg", hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                 average_aggregated_gradients=True), B),
        ("passes2_sum", hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05), backward_passes_per_step=2), B),
        ("double_batch", hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), 2 * B),
        ("predivide", hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0), 2 * B),
        ("groups", hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), num_groups=2), 2 * B),
    ]:
        model = _model(tf, 0)
        _fit(model, opt, xs, ys, batch)
        runs[label] = model.get_weights()
        got[f"iterations_{label}"] = int(opt.iterations.numpy())
    for label in ("passes2_avg", "passes2_sum", "predivide", "groups"):
        got[f"{label}_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(runs[label], runs["double_batch"]))
    got["double_batch_moved"] = float(np.max(np.abs(runs["double_batch"][0] - _model(tf, 0).get_weights()[0])))


def schedules(got, hvd, tf, x, y):
    """Warm-up on a new optimizer, a decaying schedule with momentum correction on a legacy SGD."""
    model = _model(tf, 0)
    _fit(model, hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.002)), x[:320], y[:320], 32, epochs=2,
         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.002, warmup_epochs=2)])
    got["warmup_final_lr"] = float(model.optimizer.learning_rate.numpy())
    model = _model(tf, 0)
    history = _fit(model, hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)), x[:320],
                   y[:320], 32, epochs=3, callbacks=[
                       hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                       hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5)])
    got["schedule_lrs"] = [float(v) for v in history.history["lr"]]


def state_and_files(got, hvd, tf, r, outdir, x, y):
    """save_model and load_model, KerasState, SyncBatchNormalization, and the refusal of a Keras 3 model."""
    import numpy as np

    model = _model(tf, 0)
    _fit(model, hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001)), x[:64], y[:64], 32,
         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    path = hvd.save_model(model, os.path.join(outdir, "model.keras"))
    got["saved_by"] = path is not None
    hvd.allreduce(tf.constant(0.0))  # rank 0 has written the file before anyone reads it
    loaded = hvd.load_model(os.path.join(outdir, "model.keras"))
    got["loaded_optimizer"] = [type(loaded.optimizer).__name__,
                               getattr(type(loaded.optimizer), "_sparktrain_distributed", False),
                               weights_digest(loaded.get_weights()) == weights_digest(model.get_weights())]
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.commit()
    kept = weights_digest(model.get_weights())
    model.set_weights([w + 1 for w in model.get_weights()])
    state.epoch = 7
    state.restore()
    got["state_restored"] = [weights_digest(model.get_weights()) == kept, state.epoch]
    bn = hvd.SyncBatchNormalization(momentum=0.0)
    bn(tf.fill((4, 3), 2.0 * r), training=True)  # rank 0's batch is all 0, rank 1's all 2: the global mean is 1
    got["sync_bn"] = [type(bn).__module__, [float(v) for v in np.asarray(bn.moving_mean)]]
    import keras  # Keras 3, beside tf_keras in one process: a model of it is refused, naming both

    try:
        hvd.callbacks.MetricAverageCallback().set_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        got["mixed_refused"] = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        got["mixed_refused"] = f"{type(e).__name__}: {e}"


def tracking_checkpoints_and_elastic(got, hvd, tf, r, outdir, x, y):
    """MLflowLogger (rank 0 logs to a file store; the model with MLflow's TensorFlow flavour),
    RemoteCheckpoint and restore, and the elastic callbacks keeping a KerasState current."""
    os.environ["MLFLOW_TRACKING_URI"] = f"file://{outdir}/mlruns"
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # a file store is enough here (no server to start)
    model = _model(tf, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    logger = hvd.callbacks.MLflowLogger(batch_size=32)
    model.fit(x[:320], y[:320], batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
        logger,
        hvd.callbacks.RemoteCheckpoint(f"file://{outdir}/remote/epoch-{{epoch}}.keras", monitor="loss"),
        hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=4)])
    got["elastic_state"] = [state.epoch, state.batch]
    hvd.allreduce(tf.constant(0.0))  # rank 0 has written its checkpoints and logged the model
    restored, epoch = hvd.restore(f"file://{outdir}/remote")
    got["restored"] = [epoch, type(restored).__module__.split(".")[0], type(restored.optimizer).__name__,
                       getattr(type(restored.optimizer), "_sparktrain_distributed", False)]
    if r == 0:
        import mlflow

        run = mlflow.get_run(logger.run_id)
        models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list",
                                             filter_string=f"source_run_id='{run.info.run_id}'")
        requirements = open(mlflow.artifacts.download_artifacts(
            f"runs:/{run.info.run_id}/model/requirements.txt", dst_path=f"{outdir}/deps")).read().split()
        got["mlflow"] = [sorted(run.data.metrics), run.data.params.get("num_proc"), [m.name for m in models],
                         [q.split("==")[0] for q in requirements if q.startswith(("tf_keras", "tensorflow"))]]


def buckets_against_fused(got, hvd, tf, outdir, x, y):
    """The same fits fused and in gradient buckets (of 512 bytes: one a layer)."""
    import json

    from overlap_ranks import bucket_bytes

    for label, make in [("adam", lambda: hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01))),
                        ("legacy_sgd_predivide", lambda: hvd.DistributedOptimizer(
                            tf.keras.optimizers.legacy.SGD(0.05), gradient_predivide_factor=2.0)),
                        ("fp16_groups", lambda: hvd.DistributedOptimizer(
                            tf.keras.optimizers.SGD(0.05), compression=hvd.Compression.fp16, num_groups=2))]:
        digests = []
        for limit in (0, 512):
            trace = os.path.join(outdir, f"buckets-{label}-{limit}.json")
            hvd.start_timeline(trace)
            with bucket_bytes(limit):
                model = _model(tf, 0, hidden=16)
                _fit(model, make(), x[:320], y[:320], 32)
            written = hvd.stop_timeline()
            digests.append(weights_digest(model.get_weights()))
            with open(written) as f:
                names = {e["name"].split(" (")[0] for e in json.load(f)["traceEvents"] if e.get("tid") == 1}
            got[f"bucket_names_{label}_{limit}"] = sorted(names - {"thread_name"})
        got[f"buckets_{label}"] = digests


def tf_keras_checks(outdir):
    import tensorflow as tf

    import sparktrain.keras as hvd
    import sparktrain.tensorflow.keras as hvd_path

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    (x, y), (x_test, y_test) = digits(r, n)
    got: dict = {"keras_line": tf.keras.__name__.split(".")[0], "alias": hvd_path is hvd,
                 "callback_base": hvd.callbacks.BroadcastGlobalVariablesCallback.__mro__[2].__module__}
    reduction_rules(got, hvd, tf, r)
    fit_and_callbacks(got, hvd, tf, r, outdir, x, y, x_test, y_test)
    accumulation(got, hvd, tf, x, y)
    schedules(got, hvd, tf, x, y)
    state_and_files(got, hvd, tf, r, outdir, x, y)
    tracking_checkpoints_and_elastic(got, hvd, tf, r, outdir, x, y)
    buckets_against_fused(got, hvd, tf, outdir, x, y)
    record_rank(outdir, got=got)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("hvd_tf_keras")
    sparktrain.run(tf_keras_checks, args=(str(outdir),), num_proc=-2, env=ENV, verbose=0)
    found = read_ranks(str(outdir))
    assert sorted(found) == [0, 1]
    return {r: info["got"] for r, info in found.items()}, outdir


@pytest.mark.timeout(400)
def test_the_ranks_serve_tf_keras_through_both_import_paths(ranks):
    ranks, _ = ranks
    assert same_on_every_rank(ranks, "keras_line") == "tf_keras"
    assert same_on_every_rank(ranks, "alias") is True
    assert same_on_every_rank(ranks, "callback_base").startswith("tf_keras.")


def test_gradients_are_averaged_summed_and_clipped_after_the_reduction(ranks):
    ranks, _ = ranks
    for family in ("new", "legacy"):
        assert same_on_every_rank(ranks, f"{family}_average_step") == pytest.approx(-0.5)
        assert same_on_every_rank(ranks, f"{family}_sum_step") == pytest.approx(-2.0)
        assert same_on_every_rank(ranks, f"{family}_clipped_step") == pytest.approx(0.5)
    assert same_on_every_rank(ranks, "private_compute") == [1.5, True]
    assert same_on_every_rank(ranks, "agg_counter") == [1, 0, 1]


def test_an_overflow_on_one_rank_is_skipped_by_every_rank(ranks):
    ranks, _ = ranks
    for family in ("new", "legacy"):
        w, scale, inner_distributed = same_on_every_rank(ranks, f"{family}_overflow")
        assert w == 1.0 and scale == 2.0 ** 14 and inner_distributed  # skipped, scale halved from 2**15
        assert same_on_every_rank(ranks, f"{family}_after_overflow") == pytest.approx(0.9)


def test_both_optimizer_families_train_to_identical_weights_with_the_callbacks(ranks):
    ranks, outdir = ranks
    assert same_on_every_rank(ranks, "adam_class") == ["Adam", "tf_keras", True]
    assert same_on_every_rank(ranks, "legacy_adadelta_class") == ["Adadelta", "tf_keras", True]
    for label in ("adam", "legacy_adadelta"):
        same_on_every_rank(ranks, f"{label}_digest")  # from each rank's own initial weights
        loss = same_on_every_rank(ranks, f"{label}_loss")  # averaged by MetricAverageCallback
        assert loss[-1] < loss[0], loss
    # Adam learns the digits in 3 epochs (0.81 in one process at this rate); Adadelta only starts to.
    assert ranks[0]["adam_accuracy"] > 0.7, ranks[0]["adam_accuracy"]
    # BestModelCheckpoint: rank 0 wrote each file; rank 1 none (it would have raced rank 0 on the name).
    assert same_on_every_rank(ranks, "best_files") == ["best-adam.h5", "best-legacy_adadelta.h5"]


def test_backward_passes_per_step_equals_one_pass_over_twice_the_batch(ranks):
    ranks, _ = ranks
    for got in ranks.values():
        assert got["double_batch_moved"] > 1e-3
        for label in ("passes2_avg", "passes2_sum", "predivide", "groups"):
            assert got[f"{label}_max_diff"] < 1e-6, (label, got[f"{label}_max_diff"])
        # iterations counts passes, as under Horovod's Keras 2 wrapper: 12 passes make 6 updates.
        assert got["iterations_passes2_avg"] == 12 and got["iterations_passes2_sum"] == 12
        assert got["iterations_double_batch"] == 6


def test_learning_rate_warmup_and_schedule_on_tf_keras_optimizers(ranks):
    ranks, _ = ranks
    assert same_on_every_rank(ranks, "warmup_final_lr") == pytest.approx(0.002)
    assert same_on_every_rank(ranks, "schedule_lrs") == pytest.approx([0.1, 0.05, 0.025])


def test_load_model_state_sync_batch_norm_and_the_refused_mix(ranks):
    ranks, _ = ranks
    assert [ranks[r]["saved_by"] for r in (0, 1)] == [True, False]
    assert same_on_every_rank(ranks, "loaded_optimizer") == ["Adam", True, True]
    assert same_on_every_rank(ranks, "state_restored") == [True, 0]
    module, mean = same_on_every_rank(ranks, "sync_bn")
    assert module == "sparktrain.keras.fronts.tf_keras" and mean == [1.0, 1.0, 1.0]
    refused = same_on_every_rank(ranks, "mixed_refused")
    assert refused.startswith("InvalidArgumentError") and "tf_keras" in refused and "Keras 3" in refused, refused


def test_mlflow_remote_checkpoints_and_the_elastic_callbacks_on_tf_keras(ranks):
    ranks, _ = ranks
    assert same_on_every_rank(ranks, "elastic_state") == [2, 0]  # two epochs done, at an epoch's end
    assert same_on_every_rank(ranks, "restored") == [2, "tf_keras", "Adam", True]
    metrics, num_proc, models, pinned = ranks[0]["mlflow"]
    assert {"loss", "accuracy"} <= set(metrics) and num_proc == "2" and models == ["model"], ranks[0]["mlflow"]
    assert sorted(pinned) == ["tensorflow", "tf_keras"], pinned  # the model's Keras is tf_keras


def test_gradient_buckets_give_tf_keras_the_fused_reductions_bits(ranks):
    got, _ = ranks
    labels = ("adam", "legacy_sgd_predivide", "fp16_groups")
    for label in labels:
        fused, bucketed = got[0][f"buckets_{label}"]
        assert fused == bucketed, label
        assert got[1][f"buckets_{label}"] == [fused, bucketed], label  # and every rank's are the same
        assert got[0][f"bucket_names_{label}_0"] == []  # fused: nothing on the engine's lane
    # Each layer's kernel closes a bucket (with the bias after it, filled first); two groups, each a bucket.
    assert got[0]["bucket_names_adam_512"] == ["gradient bucket 1/2", "gradient bucket 2/2"]
    assert got[0]["bucket_names_fp16_groups_512"] == ["gradient bucket 1/2", "gradient bucket 2/2"]
    assert len({got[0][f"buckets_{label}"][0] for label in labels}) == len(labels)
