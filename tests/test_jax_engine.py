"""Keras 3 on JAX with ``sparktrain.keras.DistributedOptimizer``: gradients through the native engine.

Each run fits the same MLP on the same global batches twice on real ranks of a local Spark: first
under ``keras.distribution.DataParallel`` (XLA's collectives, today's path), then with the
distribution unset and ``hvd.DistributedOptimizer`` (one fused buffer per step through the native
engine, in its XLA FFI handler) with the broadcast and metric-average callbacks. Both start from the same weights; the
tests compare what they end with, on 2 and 3 ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks, record_rank, skip_without_jax

skip_without_jax()
pytestmark = [pytest.mark.timeout(240), pytest.mark.jax]

spark = module_spark("local[3]")
#: Rows per rank per step, steps per epoch, epochs.
BATCH, STEPS, EPOCHS = 16, 6, 2


def fit_both_ways(outdir: str, x, y, passes: int):
    import hashlib

    import keras

    import sparktrain.keras as hvd
    from sparktrain._jax import ffi as jax_ffi

    keras.utils.set_random_seed(5)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    glob = BATCH * size

    class Part(keras.utils.PyDataset):
        """This rank's rows of each global batch: the same batches on both paths."""

        def __len__(self):
            return STEPS

        def __getitem__(self, i):
            rows = slice(i * glob + rank * BATCH, i * glob + (rank + 1) * BATCH)
            return x[rows], y[rows]

    def mlp():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(10)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    today = mlp()
    start = [np.asarray(w) for w in today.get_weights()]
    today.compile(keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=passes if passes > 1 else None),
                  loss)
    today.fit(Part(), epochs=EPOCHS, verbose=0, shuffle=False)
    expected = [np.asarray(w) for w in today.get_weights()]

    keras.distribution.set_distribution(None)
    fused = mlp()
    # Each rank starts elsewhere; the broadcast callback gives every rank rank 0's start.
    fused.set_weights([w + (0.5 * rank) for w in start])
    fused.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), backward_passes_per_step=passes,
                                           average_aggregated_gradients=True), loss)
    seen = {}

    class Seen(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen["loss"] = float(logs["loss"])

    history = fused.fit(Part(), epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback(), Seen()])
    got = [np.asarray(w) for w in fused.get_weights()]
    record_rank(outdir, got={"max_difference": max(float(np.max(np.abs(a - b))) for a, b in zip(expected, got)),
            "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(start, got)),
            "digest": hashlib.sha256(b"".join(w.tobytes() for w in got)).hexdigest(),
            "loss": seen["loss"], "history": history.history["loss"],
            "optimizer": type(fused.optimizer).__name__, "ffi": jax_ffi.ready()})


def run_both_ways(outdir: str, ranks: int, passes: int = 1) -> list:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    n = BATCH * ranks * STEPS
    x, y = (x[:n] / 16).astype(np.float32), y[:n].astype(np.int32)
    sparktrain.run(fit_both_ways, args=(outdir, x, y, passes), num_proc=ranks, backend="jax", verbose=0, timeout=200)
    return [info["got"] for _, info in sorted(read_ranks(outdir).items())]


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_fused_engine_path_ends_with_the_weights_of_data_parallel(spark, tmp_path, ranks):
    results = run_both_ways(str(tmp_path), ranks)
    assert len(results) == ranks
    assert len({r["digest"] for r in results}) == 1  # every rank holds the same weights: the gradients were reduced
    assert len({r["loss"] for r in results}) == 1  # the metric-average callback agreed on the epoch's loss
    for r in results:
        assert r["optimizer"] == "SGD"  # the user's class name, as a saved model names it
        assert r["ffi"] is True  # reduced in the XLA FFI handler (built at init), no Python in the step
        assert r["moved"] > 1e-2  # training changed the weights
        assert r["max_difference"] < 1e-5, r  # the same weights as today's path, to float32 rounding


def test_accumulated_passes_reduce_once_per_update_and_match_data_parallel(spark, tmp_path):
    results = run_both_ways(str(tmp_path), 2, passes=2)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["max_difference"] < 1e-5, r
