"""Horovod's Spark KerasEstimator example (examples/spark/keras/keras_spark_mnist.py), on
scikit-learn's bundled 8x8 digits written as libsvm instead of MNIST downloaded.

A Horovod estimator script whose only sparktrain-specific lines are the imports: run it with
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

parser = argparse.ArgumentParser(description='Keras Spark digits Example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='spark master to connect to')
parser.add_argument('--num-proc', type=int,
                    help='number of worker processes for training, default: `spark.default.parallelism`')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--epochs', type=int, default=3,
                    help='number of epochs to train')
parser.add_argument('--work-dir', default='/tmp',
                    help='temporary working directory to write intermediate files (prefix with hdfs:// to use HDFS)')
parser.add_argument('--data-dir', default='/tmp',
                    help='location of the training dataset in the local filesystem (will be written if missing)')

if __name__ == '__main__':
    args = parser.parse_args()

    # Initialize SparkSession
    conf = SparkConf().setAppName('keras_spark_digits').set('spark.sql.shuffle.partitions', '4')
    if args.master:
        conf.setMaster(args.master)
    elif args.num_proc:
        conf.setMaster('local[{}]'.format(args.num_proc))
    spark = SparkSession.builder.config(conf=conf).getOrCreate()

    # Setup our store for intermediate data
    store = Store.create(args.work_dir)

    # Write the digits in libsvm format (one-based indices, as Spark's reader expects)
    libsvm_path = os.path.join(args.data_dir, 'digits.libsvm')
    if not os.path.exists(libsvm_path):
        x, y = load_digits(return_X_y=True)
        dump_svmlight_file(x / 16.0, y, libsvm_path, zero_based=False)

    # Load dataset into a Spark DataFrame
    df = spark.read.format('libsvm') \
        .option('numFeatures', '64') \
        .load(libsvm_path)

    # One-hot encode labels into SparseVectors
    encoder = OneHotEncoder(inputCols=['label'],
                            outputCols=['label_vec'],
                            dropLast=False)
    model = encoder.fit(df)
    train_df = model.transform(df)

    # Train/test split
    train_df, test_df = train_df.randomSplit([0.85, 0.15], seed=7)

    # Disable GPUs when building the model to prevent memory leaks
    os.environ['CUDA_VISIBLE_DEVICES'] = '-1'

    # Define the Keras model without any Horovod-specific parameters
    model = keras.Sequential()
    model.add(keras.Input((8, 8, 1)))
    model.add(keras.layers.Conv2D(16, kernel_size=(3, 3), padding='same', activation='relu'))
    model.add(keras.layers.MaxPooling2D(pool_size=(2, 2)))
    model.add(keras.layers.Flatten())
    model.add(keras.layers.Dense(32, activation='relu'))
    model.add(keras.layers.Dense(10, activation='softmax'))

    optimizer = keras.optimizers.Adam(0.005)
    loss = keras.losses.categorical_crossentropy

    # Train a Horovod Spark Estimator on the DataFrame
    backend = SparkBackend(num_proc=args.num_proc,
                           stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    keras_estimator = hvd.KerasEstimator(backend=backend,
                                         store=store,
                                         model=model,
                                         optimizer=optimizer,
                                         loss=loss,
                                         metrics=['accuracy'],
                                         feature_cols=['features'],
                                         label_cols=['label_vec'],
                                         batch_size=args.batch_size,
                                         epochs=args.epochs,
                                         inmemory_cache_all=True,
                                         verbose=1)

    keras_model = keras_estimator.fit(train_df).setOutputCols(['label_prob'])

    # Evaluate the model on the held-out test DataFrame
    pred_df = keras_model.transform(test_df)
    argmax = udf(lambda v: float(np.argmax(v)), returnType=DoubleType())
    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label', metricName='accuracy')
    print('Test accuracy:', evaluator.evaluate(pred_df))

    spark.stop()
