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

parser = argparse.ArgumentParser(description="TensorFlow 2 synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="small",
                    help="'small' (a few convolutions) or a model name from keras.applications")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=8, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches that don't count")
parser.add_argument("--num-batches-per-iter", type=int, default=3, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Set up standard model.
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

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def benchmark_step(first_batch):
    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, probs))

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
log(f"Number of {device}s: {hvd.size()}")

# Warm-up
log("Running warmup...")
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
