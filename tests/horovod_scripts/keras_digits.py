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

parser = argparse.ArgumentParser(description="Train a small convnet on the 8x8 digits on every rank")
parser.add_argument("--epochs", type=int, default=4, help="passes over each rank's shard")
parser.add_argument("--batch-size", type=int, default=32, help="examples per batch on each rank")
parser.add_argument("--lr", type=float, default=0.002,
                    help="the rate for one rank; the script multiplies it by the number of ranks")
parser.add_argument("--warmup-epochs", type=int, default=1,
                    help="epochs over which the rate climbs to its scaled value")
parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients between ranks as float16")
parser.add_argument("--backward-passes-per-step", type=int, default=1,
                    help="batches whose gradients each rank adds up before one exchange and update")
parser.add_argument("--checkpoint-dir", default="./checkpoints", help="folder for rank 0's checkpoint of each epoch")
args = parser.parse_args()

# Join the other ranks before anything else.
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

# A step averages the gradients of every rank's batch, so the rate grows with the number of ranks.
scaled_lr = args.lr * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# The wrapper averages gradients across ranks before each update.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, compression=compression,
                               backward_passes_per_step=args.backward_passes_per_step,
                               average_aggregated_gradients=True)

model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Every rank starts from rank 0's weights.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # The epoch's logged metrics are the mean over ranks, not rank 0's alone.
    hvd.callbacks.MetricAverageCallback(),
    # The scaled rate is reached step by step, not at the first batch.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1),
    # From the third epoch on, each epoch runs at half the rate of the one before.
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.5, start_epoch=2),
]

# One writer: rank 0 saves; two ranks writing the same file could leave it torn.
if hvd.rank() == 0:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

# Progress lines from rank 0 only.
verbose = 2 if hvd.rank() == 0 else 0

# An epoch is one pass over this rank's shard, a 1/size part of the training rows.
model.fit(dataset, steps_per_epoch=len(x_train) // args.batch_size, callbacks=callbacks, epochs=args.epochs,
          verbose=verbose)

loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"rank {hvd.rank()} of {hvd.size()}: test accuracy {accuracy:.4f}, test loss {loss:.6f}")
