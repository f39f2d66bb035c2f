"""Keras 3 training of a small convnet on scikit-learn's bundled 8x8 digits, Horovod style.

A Horovod TF2/Keras script whose only sparktrain-specific line is the import: run it with
``sparktrain run keras_digits.py --num-proc 3 -- --epochs 4``.
"""
import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import sparktrain.keras as hvd

parser = argparse.ArgumentParser(description="Keras digits example")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.002, help="learning rate of one process")
parser.add_argument("--warmup-epochs", type=int, default=1)
parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
parser.add_argument("--backward-passes-per-step", type=int, default=1)
parser.add_argument("--checkpoint-dir", default="./checkpoints")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# The same shuffled split on every worker; each worker trains on its own shard.
images, labels = load_digits(return_X_y=True)
images = (images / 16.0).astype("float32").reshape(-1, 8, 8, 1)
order = np.random.default_rng(42).permutation(len(images))
images, labels = images[order], labels[order]
x_train, y_train = images[:1500][hvd.rank()::hvd.size()], labels[:1500][hvd.rank()::hvd.size()]
x_test, y_test = images[1500:], labels[1500:]

dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().shuffle(1000, seed=hvd.rank()) \
    .batch(args.batch_size)

model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
    keras.layers.Flatten(),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of workers.
scaled_lr = args.lr * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, compression=compression,
                               backward_passes_per_step=args.backward_passes_per_step,
                               average_aggregated_gradients=True)

model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: scale the learning rate up gradually over the first epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1),
    # Horovod: then halve it every epoch from epoch 3 on.
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.5, start_epoch=2),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0

# Horovod: each worker sees 1 / size of the data per epoch.
model.fit(dataset, steps_per_epoch=len(x_train) // args.batch_size, callbacks=callbacks, epochs=args.epochs,
          verbose=verbose)

loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"rank {hvd.rank()} of {hvd.size()}: test accuracy {accuracy:.4f}, test loss {loss:.6f}")
