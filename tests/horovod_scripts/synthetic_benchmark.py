"""Synthetic images/second of a Keras 3 model trained with a DistributedGradientTape, Horovod style.

A Horovod TF2 benchmark script whose only sparktrain-specific lines are the imports: run it with
``sparktrain run synthetic_benchmark.py --num-proc 3 -- --model ResNet50 --batch-size 32``.
"""
import argparse
import timeit

import keras
import numpy as np
import tensorflow as tf

import sparktrain.tensorflow as hvd

parser = argparse.ArgumentParser(description="Images per second of a model trained on random data on every rank",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="send gradients between ranks as float16")
parser.add_argument("--model", type=str, default="small",
                    help="'small' (a few convolutions) or a model name from keras.applications")
parser.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
parser.add_argument("--batch-size", type=int, default=8, help="images in each rank's batch")
parser.add_argument("--num-warmup-batches", type=int, default=2,
                    help="batches run and left out of the timing, after the first")
parser.add_argument("--num-batches-per-iter", type=int, default=3, help="batches timed together as one measurement")
parser.add_argument("--num-iters", type=int, default=3, help="how many measurements to take")
args = parser.parse_args()

# Join the other ranks before anything else.
hvd.init()

# The model to time: a small convnet, or one of keras.applications by name.
if args.model == "small":
    model = keras.Sequential([
        keras.Input((args.image_size, args.image_size, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(1000, activation="softmax"),
    ])
else:
    model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.image_size, args.image_size, 3))
opt = keras.optimizers.SGD(0.01)
opt.build(model.trainable_variables)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
labels = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def train_step(then_broadcast):
    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))
    # Wrapped, the tape returns gradients averaged across ranks.
    averaged = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(averaged, model.trainable_variables))
    # Ranks start with different random weights: after the first step, when the optimizer's own
    # variables exist too, every rank takes rank 0's.
    if then_broadcast:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def log(line):
    """Print on rank 0 alone: one report, not one per rank."""
    if hvd.rank() == 0:
        print(line)


def seconds_for(steps):
    return timeit.timeit(lambda: train_step(then_broadcast=False), number=steps)


device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
# The report's lines read as Horovod's benchmark prints them, so that its numbers can be compared.
log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
log(f"Number of {device}s: {hvd.size()}")

# Untimed: the first step traces the function and broadcasts; a few more settle the caches.
log("Warming up...")
train_step(then_broadcast=True)
seconds_for(args.num_warmup_batches)

log("Timing...")
rates = []
for i in range(args.num_iters):
    rates.append(args.batch_size * args.num_batches_per_iter / seconds_for(args.num_batches_per_iter))
    log(f"Iter #{i}: {rates[-1]:.1f} img/sec per {device}")

# The mean, and 1.96 standard deviations either side of it; the total is the mean times the ranks.
mean, spread = np.mean(rates), 1.96 * np.std(rates)
log(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
