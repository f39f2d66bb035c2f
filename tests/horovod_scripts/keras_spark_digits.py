"""A Spark KerasEstimator script in the shape of Horovod's Spark Keras MNIST example: the same calls with
the same parameters, on scikit-learn's bundled 8x8 digits (written out as a libsvm file) where
Horovod's downloads MNIST.

Only the imports name sparktrain; the rest is what a Horovod estimator script calls. Run it with
``python keras_spark_digits.py --num-proc 2 --work-dir /tmp/digits``.
"""
import argparse
import os
import sys

import numpy as np
from pyspark import SparkConf
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import OneHotEncoder
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf
from pyspark.sql.types import DoubleType
from sklearn.datasets import dump_svmlight_file, load_digits
from tensorflow import keras

import sparktrain.ml as hvd
from sparktrain.ml import SparkBackend, Store

parser = argparse.ArgumentParser(description='Train a small convnet on the 8x8 digits with a Spark KerasEstimator',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='Spark master URL; without it the session runs on local[num-proc]')
parser.add_argument('--num-proc', type=int,
                    help='how many ranks train the model; left out, the backend takes Spark\'s default parallelism')
parser.add_argument('--batch-size', type=int, default=32,
                    help='examples per batch on each rank')
parser.add_argument('--epochs', type=int, default=3,
                    help='passes over the training rows')
parser.add_argument('--work-dir', default='/tmp',
                    help='where the Store keeps its prepared data, checkpoints and logs (a local path or any URL '
                         'the Store takes)')
parser.add_argument('--data-dir', default='/tmp',
                    help='local folder of digits.libsvm, which the script writes there when it is absent')


def digits_libsvm(data_dir):
    """The path of the digits as libsvm rows, pixels in [0, 1]; Spark's libsvm reader wants indices from 1."""
    path = os.path.join(data_dir, 'digits.libsvm')
    if not os.path.exists(path):
        pixels, labels = load_digits(return_X_y=True)
        dump_svmlight_file(pixels / 16.0, labels, path, zero_based=False)
    return path


def convnet():
    """A plain Keras model: nothing in it knows about distributed training."""
    net = keras.Sequential()
    net.add(keras.Input((8, 8, 1)))
    net.add(keras.layers.Conv2D(16, kernel_size=(3, 3), padding='same', activation='relu'))
    net.add(keras.layers.MaxPooling2D(pool_size=(2, 2)))
    net.add(keras.layers.Flatten())
    net.add(keras.layers.Dense(32, activation='relu'))
    net.add(keras.layers.Dense(10, activation='softmax'))
    return net


def main(args):
    conf = SparkConf().setAppName('keras_spark_digits').set('spark.sql.shuffle.partitions', '4')
    master = args.master or (f'local[{args.num_proc}]' if args.num_proc else None)
    spark = SparkSession.builder.config(conf=conf if master is None else conf.setMaster(master)).getOrCreate()
    store = Store.create(args.work_dir)

    rows = spark.read.format('libsvm').option('numFeatures', '64').load(digits_libsvm(args.data_dir))
    # The softmax wants each label as a one-hot vector; keep all ten slots (dropLast=False).
    one_hot = OneHotEncoder(inputCols=['label'], outputCols=['label_vec'], dropLast=False).fit(rows)
    train_df, test_df = one_hot.transform(rows).randomSplit([0.85, 0.15], seed=7)

    # As Horovod's example does: the driver builds the model on its CPU, leaving GPUs to the ranks.
    os.environ['CUDA_VISIBLE_DEVICES'] = '-1'

    backend = SparkBackend(num_proc=args.num_proc,
                           stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    estimator = hvd.KerasEstimator(backend=backend,
                                   store=store,
                                   model=convnet(),
                                   optimizer=keras.optimizers.Adam(0.005),
                                   loss=keras.losses.categorical_crossentropy,
                                   metrics=['accuracy'],
                                   feature_cols=['features'],
                                   label_cols=['label_vec'],
                                   batch_size=args.batch_size,
                                   epochs=args.epochs,
                                   inmemory_cache_all=True,
                                   verbose=1)
    trained = estimator.fit(train_df).setOutputCols(['label_prob'])

    # Score the rows held back, and compare the most likely digit with the label.
    scored = trained.transform(test_df)
    most_likely = udf(lambda probs: float(np.argmax(probs)), returnType=DoubleType())
    scored = scored.withColumn('label_pred', most_likely(scored.label_prob))
    accuracy = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label',
                                                 metricName='accuracy').evaluate(scored)
    print('Test accuracy:', accuracy)
    spark.stop()


if __name__ == '__main__':
    main(parser.parse_args())
