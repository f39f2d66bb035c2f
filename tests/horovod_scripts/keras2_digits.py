"""A Keras 2 training script as ``horovodrun`` would start it: ``tf.keras`` is tf_keras under
``TF_USE_LEGACY_KERAS=1``. It is built like Horovod's TensorFlow 2 Keras MNIST example and makes its
calls with its parameters; the data is scikit-learn's 8x8 digits, from a .npz file its caller wrote.

Only the import of ``hvd`` names sparktrain. Run it with
``TF_USE_LEGACY_KERAS=1 sparktrain run keras2_digits.py --num-proc 2 -- --data digits.npz``.
"""
import argparse

import numpy as np
import tensorflow as tf

import sparktrain.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description="Keras 2 (tf.keras) convnet on the 8x8 digits, on every rank")
parser.add_argument("--data", required=True,
                    help=".npz file with x and y (training images and labels) and x_test and y_test")
parser.add_argument("--epochs", type=int, default=24, help="how many epochs fit runs")
parser.add_argument("--steps", type=int, default=500,
                    help="batches in an epoch over all ranks together; each rank runs its share of them")
parser.add_argument("--batch-size", type=int, default=128, help="images in each rank's batch")


def main(args):
    hvd.init()

    # No GPU pinning here, where Horovod's script picks gpus[local_rank]: each rank already sees
    # only the GPU Spark gave its task, so that list has one entry.

    arrays = np.load(args.data)
    images = tf.cast(arrays["x"].reshape(-1, 8, 8, 1), tf.float32)
    # Each rank reads every size-th example, starting at its rank: shards that do not overlap.
    shard = tf.data.Dataset.from_tensor_slices((images, tf.cast(arrays["y"], tf.int64))) \
        .shard(hvd.size(), hvd.rank())
    batches = shard.repeat().shuffle(10000).batch(args.batch_size)

    net = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    # Every step averages the gradients of size batches, so the rate is size times one process's.
    rate = 0.001 * hvd.size()
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(rate),
                                         backward_passes_per_step=1, average_aggregated_gradients=True)
    # Horovod's script passes experimental_run_tf_function=False, so that Keras 2 takes its gradients
    # from the optimizer it was given.
    net.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=optimizer, metrics=["accuracy"],
                experimental_run_tf_function=False)

    callbacks = [
        # Rank 0's starting weights on every rank.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Epoch metrics averaged over the ranks; it comes before any callback that reads them.
        hvd.callbacks.MetricAverageCallback(),
        # The scaled rate from the start trains worse: climb to it over three epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=rate, warmup_epochs=3, verbose=1),
    ]
    if hvd.rank() == 0:  # a single writer for the checkpoints
        callbacks.append(tf.keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.h5"))
    verbose = 1 if hvd.rank() == 0 else 0  # one progress display, rank 0's

    net.fit(batches, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks, epochs=args.epochs,
            verbose=verbose)

    loss, accuracy = net.evaluate(arrays["x_test"].reshape(-1, 8, 8, 1), arrays["y_test"], verbose=0)
    print(f"rank {hvd.rank()} of {hvd.size()}: {type(net).__module__.split('.')[0]} model, "
          f"test accuracy {accuracy:.4f}, test loss {loss:.6f}")


if __name__ == "__main__":
    main(parser.parse_args())
