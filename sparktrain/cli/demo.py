"""The demo behind ``sparktrain demo``: a small Keras 3 CNN on scikit-learn's digits, 3 ranks.

Everything it needs ships with scikit-learn (the 8x8 digits), so nothing is downloaded.
"""
from __future__ import annotations


def digits(rank: int = 0, size: int = 1, n_train: int = 1500):
    """The digits data, shuffled the same way on every rank: ``rank``'s training shard and the test set.

    Pixels are scaled to [0, 1]; shards are ``x[rank::size]`` of the first ``n_train`` images.
    """
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:n_train][rank::size], y[:n_train][rank::size]), (x[n_train:], y[n_train:])


def build_cnn(keras=None):
    """The demo's CNN for 8x8 digits; ``keras`` may be another Keras module (tf_keras) with the same layers."""
    if keras is None:
        import keras

    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def train(epochs: int, per_rank_batch: int, lr: float) -> bytes | None:
    """Horovod-style data-parallel training; rank 0 returns the saved model's bytes."""
    import os
    import tempfile

    import keras

    import sparktrain.keras as hvd

    hvd.init()
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size())
    model = build_cnn()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(lr * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x.reshape(-1, 8, 8, 1), y, batch_size=per_rank_batch, epochs=epochs,
              validation_data=(x_test.reshape(-1, 8, 8, 1), y_test), verbose=2 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
    with tempfile.TemporaryDirectory() as tmp:
        path = hvd.save_model(model, os.path.join(tmp, "model.keras"))  # None on ranks other than 0
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
