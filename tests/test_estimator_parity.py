"""KerasEstimator's history equals one process's ``model.fit`` on the same rows, in the same order,
in the same global batches, to float32 tolerance, on each Keras line (Keras 3 with the ranks on
TensorFlow, Keras 3 with the ranks on JAX, tf_keras): one fit per line, of one model of two inputs
and four outputs that holds the cases, trained with sample weights:

- ``reg``: a regression, scored by custom metric functions (``my_mae``, and ``label_rank``, the
  rank of ``y_true`` the metric sees: 2, as in ``y_pred``'s ``(batch, 1)``);
- ``bin``: a binary classifier (sigmoid, a 0/1 int label);
- ``cls``: several classes with sparse labels (a class id per row, fed as it is);
- ``hot``: several classes with one-hot labels (an array column).

A callback on each rank writes the rank's shard as ``sparktrain.data.numpy(..., model=...)`` gives
it (labels in the outputs' shapes); the one process fits on the global batches those shards make
(rank 0's batch i, then rank 1's). The checkpoint callback, on the custom metric, keeps the epoch
one process finds best, and the estimator's model is that epoch's."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from conftest import module_spark

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[2]")

#: Rows per rank per step (the global batch is twice that), epochs, rows.
BATCH, VAL_BATCH, EPOCHS, TRAIN, VAL = 8, 8, 4, 64, 32
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
LABELS = {"reg": "reg_y", "bin": "bin_y", "cls": "cls_y", "hot": "hot_y"}
#: Where each case's numbers are in the history.
CASES = {"regression, custom metrics": "reg_", "binary": "bin_", "sparse classes": "cls_",
         "one-hot classes": "hot_", "weighted total of 2 inputs, 4 outputs": ""}


def _on_jax(tensor) -> bool:
    """Whether Keras hands the metric JAX arrays (the ranks on JAX), not TensorFlow tensors."""
    return type(tensor).__module__.startswith("jax")


def my_mae(y_true, y_pred):
    if _on_jax(y_true):
        from keras import ops

        return ops.mean(ops.abs(y_true - y_pred))
    import tensorflow as tf

    return tf.reduce_mean(tf.abs(y_true - y_pred))


def label_rank(y_true, y_pred):
    if _on_jax(y_true):
        from keras import ops

        return ops.cast(ops.ndim(y_true), "float32") + 0.0 * ops.mean(y_pred)
    import tensorflow as tf

    return tf.cast(tf.rank(y_true), "float32") + 0.0 * tf.reduce_mean(y_pred)


def _table(n, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(n, 4)), rng.normal(size=(n, 3))
    score = a[:, 0] - a[:, 1] + 0.5 * b[:, 2]
    cls = np.digitize(a[:, 2] + b[:, 0], [-0.5, 0.5])
    return {"a": a, "b": b, "reg_y": 3 * score + 1, "bin_y": (score > 0).astype("int32"), "cls_y": cls.astype("int32"),
            "hot_y": np.eye(3)[(cls + 1) % 3], "w": rng.uniform(0.5, 1.5, n)}


def _frame(spark, table, val):
    rows = [([*map(float, table["a"][i])], [*map(float, table["b"][i])], float(table["reg_y"][i]),
             int(table["bin_y"][i]), int(table["cls_y"][i]), [*map(float, table["hot_y"][i])], float(table["w"][i]),
             bool(val[i])) for i in range(len(val))]
    return spark.createDataFrame(rows, "a array<double>, b array<double>, reg_y double, bin_y int, cls_y int, "
                                       "hot_y array<double>, w double, is_val boolean")


def _model(k):
    a, b = k.Input((4,), name="a"), k.Input((3,), name="b")
    hidden = k.layers.Dense(8, activation="tanh")(k.layers.Concatenate()([a, b]))
    outputs = [k.layers.Dense(1, name="reg")(hidden), k.layers.Dense(1, activation="sigmoid", name="bin")(hidden),
               k.layers.Dense(3, activation="softmax", name="cls")(hidden),
               k.layers.Dense(3, activation="softmax", name="hot")(hidden)]
    return k.Model([a, b], outputs)


def _compiled(k):
    return dict(optimizer=k.optimizers.SGD(0.3),
                loss={"reg": "mse", "bin": "binary_crossentropy", "cls": "sparse_categorical_crossentropy",
                      "hot": "categorical_crossentropy"},
                metrics={"reg": [my_mae, label_rank], "bin": ["accuracy"], "cls": ["accuracy"], "hot": ["accuracy"]})


def _recorder(k, outdir):
    class ShardRecorder(k.callbacks.Callback):
        """Writes this rank's shards as sparktrain.data gives them for the model: labels in its outputs' shapes."""

        def on_train_begin(self, logs=None):
            import sparktrain
            import sparktrain.data as data

            for name in ("train", "val"):
                x, y = data.numpy({"a": "a", "b": "b", "w": "w"}, LABELS, name=name, model=self.model)
                np.savez(os.path.join(outdir, f"{name}-{sparktrain.rank()}.npz"), rows=data.shard(name).rows,
                         **{f"x_{n}": v for n, v in x.items()}, **{f"y_{n}": v for n, v in y.items()})

    return ShardRecorder()


def _global_batches(outdir, name, batch):
    """The rows one process fits on: rank 0's batch i, then rank 1's, for every step (shards wrap as the ranks' do)."""
    parts = [dict(np.load(os.path.join(outdir, f"{name}-{r}.npz"))) for r in range(2)]
    rows = [int(p.pop("rows")) for p in parts]
    steps = max(math.ceil(n / batch) for n in rows)
    merged = {}
    for key in parts[0]:
        each = [p[key][:n][np.resize(np.arange(n), steps * batch)] for p, n in zip(parts, rows)]
        each = [v.reshape(steps, batch, *v.shape[1:]) for v in each]
        merged[key] = np.concatenate(each, axis=1).reshape(steps * 2 * batch, *each[0].shape[2:])
    x = {n: merged[f"x_{n}"].astype("float32") for n in ("a", "b")}
    y = [merged[f"y_{n}"].astype("float32") for n in LABELS]  # by position: Keras 3 resolves a dict's weights so
    return x, y, merged["x_w"].astype("float32")


def _keras(line):
    if line == "tf_keras":
        return pytest.importorskip("tf_keras")
    if line == "jax":
        pytest.importorskip("jax")
    import keras

    return keras


def _best(k, line):
    if line == "tf_keras":
        return k.callbacks.ModelCheckpoint("kept.keras", monitor="val_reg_my_mae", mode="min", save_best_only=True)
    from sparktrain.keras.callbacks import BestModelCheckpoint

    return BestModelCheckpoint(monitor="val_reg_my_mae", mode="min")


@pytest.mark.parametrize("line", ["keras", pytest.param("jax", marks=pytest.mark.jax),
                                  pytest.param("tf_keras", marks=pytest.mark.keras2)])
def test_the_history_equals_one_process_fit_on_the_same_global_batches(spark, tmp_path, line):
    """``line``: the model's Keras, and for Keras 3 the ranks' backend ("jax": Keras 3 on JAX, the
    one process on this process's TensorFlow backend)."""
    from sparktrain.ml import KerasEstimator

    k = _keras(line)
    k.utils.set_random_seed(4)
    table = _table(TRAIN + VAL, seed=5)
    val = np.arange(TRAIN + VAL) % 3 == 2
    model = _model(k)
    outdir = tmp_path / "shards"
    outdir.mkdir()
    est = KerasEstimator(model=model, **_compiled(k), feature_cols=["a", "b"], label_cols=list(LABELS.values()),
                         sample_weight_col="w", validation="is_val", batch_size=BATCH, val_batch_size=VAL_BATCH,
                         epochs=EPOCHS, shuffle=False, num_proc=2, store=f"file://{tmp_path}/store", verbose=0,
                         env={**ENV, "KERAS_BACKEND": "jax"} if line == "jax" else ENV,
                         callbacks=[_recorder(k, str(outdir))], checkpoint_callback=_best(k, line),
                         custom_objects={"my_mae": my_mae, "label_rank": label_rank})
    fitted = est.fit(_frame(spark, table, val))
    history = fitted.getHistory()

    (x, y, w), (xv, yv, wv) = _global_batches(outdir, "train", BATCH), _global_batches(outdir, "val", VAL_BATCH)
    assert [v.shape[1:] for v in y] == [(1,), (1,), (), (3,)]  # reg, bin, cls, hot: as the ranks read them
    one = k.models.clone_model(model)
    one.set_weights(model.get_weights())
    one.compile(**_compiled(k))
    weights = []
    keep = k.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: weights.append(one.get_weights()))
    expected = one.fit(x, y, sample_weight=w, batch_size=2 * BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                       validation_data=(xv, yv, wv), validation_batch_size=2 * VAL_BATCH, callbacks=[keep]).history

    assert set(history) == set(expected), (sorted(history), sorted(expected))
    assert history["reg_label_rank"] == [2.0] * EPOCHS and history["val_reg_label_rank"] == [2.0] * EPOCHS
    gaps = {}
    for case, prefix in CASES.items():
        keys = [key for key in expected if key.removeprefix("val_").startswith(prefix)
                and (prefix or not any(key.removeprefix("val_").startswith(p) for p in LABELS))]
        assert keys, case
        for key in keys:
            np.testing.assert_allclose(history[key], expected[key], rtol=2e-5, atol=2e-6, err_msg=f"{case}: {key}")
        gaps[case] = max(float(np.max(np.abs(np.subtract(history[key], expected[key])))) for key in keys)
    print(f"{line}: largest |estimator - one process| per case: {gaps}")
    # The metric is a function of (y_true, y_pred): the estimator's equals it as one process computes it.
    assert history["val_reg_my_mae"] != history["val_reg_loss"]

    best = int(np.argmin(expected["val_reg_my_mae"]))
    print(f"{line}: val_reg_my_mae by epoch {history['val_reg_my_mae']}, kept epoch {best + 1}")
    kept = fitted.getModel().get_weights()
    for got, want in zip(kept, weights[best]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if best != EPOCHS - 1:
        assert not all(np.allclose(g, v, rtol=1e-4, atol=1e-5) for g, v in zip(kept, weights[-1]))
