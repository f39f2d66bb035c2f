"""A store-sales regression with the Spark KerasEstimator, in the shape of Horovod's Rossmann example
(examples/spark/keras/keras_spark_rossmann_estimator.py), on a small made-up table of the same kind.

Spark joins the sales with a table of stores, splits dates into parts, indexes the categorical
columns and takes the log of the sales (a double column); the model reads every column as an
input of its own (embeddings for the categories), ends in a custom activation and is scored by a
custom metric, both passed in ``custom_objects``; a boolean column marks the validation rows and
``BestModelCheckpoint`` keeps the epoch of the lowest validation error. Its Horovod-specific lines
are the imports only. It runs on Keras 2 (``TF_USE_LEGACY_KERAS=1``: ``tf.keras`` is tf_keras) and
on Keras 3::

    TF_USE_LEGACY_KERAS=1 python keras_spark_sales_estimator.py --num-proc 2 --work-dir /tmp/sales
"""
import argparse
import datetime
import os
import sys

import numpy as np
import pyspark.sql.functions as F
import pyspark.sql.types as T
from pyspark import SparkConf
from pyspark.ml import PipelineModel
from pyspark.sql import SparkSession
from pyspark.sql.window import Window

import tensorflow as tf
from tensorflow.keras.layers import (BatchNormalization, Concatenate, Dense, Dropout, Embedding, Flatten, Input,
                                     Reshape)

import sparktrain.ml as hvd
from sparktrain.keras.callbacks import BestModelCheckpoint
from sparktrain.ml import SparkBackend, Store

LEGACY = os.environ.get('TF_USE_LEGACY_KERAS') in ('1', 'true', 'True')

parser = argparse.ArgumentParser(description='Store sales with the Spark KerasEstimator',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master', help='the Spark master; default: local[num-proc]')
parser.add_argument('--num-proc', type=int, help='training processes; default: every task slot')
parser.add_argument('--learning-rate', type=float, default=0.001, help='Adam\'s step size')
parser.add_argument('--batch-size', type=int, default=32, help='rows per batch on each process')
parser.add_argument('--val-batch-size', type=int, help='rows per validation batch on each process; default: batch size')
parser.add_argument('--epochs', type=int, default=4, help='passes over the training rows')
parser.add_argument('--width', type=int, default=256, help='units of the widest dense layer')
parser.add_argument('--stores', type=int, default=24, help='stores in the made-up table')
parser.add_argument('--days', type=int, default=60, help='days of sales per store in the made-up table')
parser.add_argument('--data-dir', default='/tmp', help='where the CSV tables are (written if missing)')
parser.add_argument('--work-dir', default='/tmp', help='the Store\'s prefix: runs, checkpoints, the trained model')
parser.add_argument('--output-dir', default='.', help='where the saved stages and the predictions go')

CATEGORICAL = ['Store', 'DayOfWeek', 'Year', 'Month', 'Week', 'Day', 'StoreType', 'Assortment', 'Promo',
               'StateHoliday', 'SchoolHoliday']
CONTINUOUS = ['CompetitionDistance', 'MeanTemperature', 'Trend', 'DaysSincePromo']
FIRST_DAY = datetime.date(2014, 3, 3)


def write_tables(directory, stores, days):
    """sales.csv (what each store sold each day), forecast.csv (the days to predict, with an Id) and
    stores.csv (one row per store), every value a string as in the files a shop would export."""
    rng = np.random.default_rng(11)
    kinds, ranges = rng.choice(list('abc'), stores), rng.choice(['basic', 'extra'], stores)
    distance = rng.integers(50, 20000, stores)
    base = rng.uniform(3000, 9000, stores) * np.where(kinds == 'b', 1.4, 1.0)
    with open(os.path.join(directory, 'stores.csv'), 'w') as f:
        f.write('Store,StoreType,Assortment,CompetitionDistance\n')
        for s in range(stores):
            far = '' if s % 7 == 3 else str(distance[s])  # some stores have no known competitor
            f.write(f'{s + 1},{kinds[s]},{ranges[s]},{far}\n')
    forecast_days = max(4, days // 6)
    with open(os.path.join(directory, 'sales.csv'), 'w') as sales, \
            open(os.path.join(directory, 'forecast.csv'), 'w') as forecast:
        sales.write('Store,Date,Sales,Open,Promo,StateHoliday,SchoolHoliday,MeanTemperature,Trend\n')
        forecast.write('Id,Store,Date,Open,Promo,StateHoliday,SchoolHoliday,MeanTemperature,Trend\n')
        ids = 0
        for d in range(days + forecast_days):
            day = FIRST_DAY + datetime.timedelta(d)
            holiday = '0' if d % 29 else 'a'
            school = '1' if 40 <= d % 90 < 50 else '0'
            temperature, trend = 12 + 10 * np.sin(d / 20), 60 + int(20 * np.cos(d / 9))
            for s in range(stores):
                is_open = day.weekday() != 6 and holiday == '0'
                promo = int((d // 7 + s) % 3 == 0)
                row = f'{s + 1},{day},{int(is_open)},{promo},{holiday},{school},{temperature:.1f},{trend}'
                if d < days:
                    amount = base[s] * (1 + 0.3 * promo) * (1.2 if day.weekday() == 0 else 1.0)
                    amount = amount * rng.lognormal(0, 0.05) if is_open else 0
                    store, date, rest = row.split(',', 2)
                    sales.write(f'{store},{date},{amount:.0f},{rest}\n')
                else:
                    ids += 1
                    forecast.write(f'{ids},{row}\n')


def prepare(df, stores_df):
    """The raw rows joined with their store, dates split into parts, flags as booleans."""
    df = df.withColumn('Date', F.to_date(df.Date))
    df = df.withColumn('Year', F.year(df.Date)).withColumn('Month', F.month(df.Date)) \
        .withColumn('Week', F.weekofyear(df.Date)).withColumn('Day', F.dayofmonth(df.Date)) \
        .withColumn('DayOfWeek', F.dayofweek(df.Date))
    for flag in ('Open', 'Promo', 'StateHoliday', 'SchoolHoliday'):
        df = df.withColumn(flag, F.col(flag) != '0')
    df = df.join(stores_df, 'Store')
    df = df.withColumn('CompetitionDistance', F.coalesce(df.CompetitionDistance, F.lit('100000')))
    # Days since the store's latest promotion day (0 on one), within the rows given.
    since = F.datediff(df.Date, F.max(F.when(df.Promo, df.Date)).over(Window.partitionBy('Store').orderBy('Date')))
    return df.withColumn('DaysSincePromo', F.coalesce(since, F.lit(30)))


def index_categories(frames, columns):
    """Each categorical column's values in a sorted list, over every frame: the position is the index."""
    both = frames[0].select(*columns).unionByName(frames[1].select(*columns))
    found = both.agg(*[F.collect_set(c).alias(c) for c in columns]).collect()[0]
    return {c: sorted(found[c], key=str) for c in columns}


def encode(df, vocabulary, continuous):
    """Continuous columns as floats (0 where missing), categorical ones as their index (ints)."""
    for column in continuous:
        df = df.withColumn(column, F.coalesce(df[column].cast(T.FloatType()), F.lit(0.0)))
    for column, values in vocabulary.items():
        # A literal map from value to index (array_position takes no column before Spark 4).
        index = F.create_map(*[part for i, v in enumerate(values) for part in (F.lit(v), F.lit(i))])
        df = df.withColumn(column, index[df[column]].cast(T.IntegerType()))
    return df


if __name__ == '__main__':
    args = parser.parse_args()

    print('Preparing the data')
    conf = SparkConf().setAppName('store sales').set('spark.sql.shuffle.partitions', '4')
    master = args.master or (f'local[{args.num_proc}]' if args.num_proc else None)
    spark = SparkSession.builder.config(conf=conf if master is None else conf.setMaster(master)).getOrCreate()

    if not os.path.exists(os.path.join(args.data_dir, 'sales.csv')):
        write_tables(args.data_dir, args.stores, args.days)
    sales_csv = spark.read.csv(os.path.join(args.data_dir, 'sales.csv'), header=True)
    forecast_csv = spark.read.csv(os.path.join(args.data_dir, 'forecast.csv'), header=True)
    stores_csv = spark.read.csv(os.path.join(args.data_dir, 'stores.csv'), header=True)

    train_df = prepare(sales_csv, stores_csv).filter(F.col('Sales') > 0)
    test_df = prepare(forecast_csv, stores_csv)
    all_cols = CATEGORICAL + CONTINUOUS
    train_df = train_df.select(*all_cols, 'Sales', 'Date').cache()
    test_df = test_df.select(*all_cols, 'Id', 'Date').cache()

    vocabulary = index_categories([train_df, test_df], CATEGORICAL)
    train_df = encode(train_df, vocabulary, CONTINUOUS + ['Sales'])
    test_df = encode(test_df, vocabulary, CONTINUOUS)

    # Every fifth day validates.
    train_df = train_df.withColumn('Validation', F.datediff(train_df.Date, F.lit(FIRST_DAY)) % 5 == 4)
    max_sales = train_df.agg(F.max(train_df.Sales)).collect()[0][0]
    train_df = train_df.withColumn('Sales', F.log(train_df.Sales))  # a double column
    print('Training rows: %d, validation rows: %d, rows to forecast: %d' % (
        train_df.filter(~train_df.Validation).count(), train_df.filter(train_df.Validation).count(), test_df.count()))

    def exp_rmspe(y_true, y_pred):
        """Root mean square percentage error of the sales, from labels and predictions in the log domain."""
        sales, predicted = tf.exp(y_true), tf.exp(y_pred)
        share = tf.square((sales - predicted) / sales)
        counted = tf.cast(y_true > 0.001, share.dtype)  # rows of no sales would divide by zero
        return tf.sqrt(tf.reduce_sum(share * counted) / tf.reduce_sum(counted))

    def scaled_sigmoid(x):
        """A sigmoid stretched to a fifth above the log of the largest sale."""
        return tf.nn.sigmoid(x) * tf.math.log(max_sales) * 1.2

    custom_objects = {'exp_rmspe': exp_rmspe, 'scaled_sigmoid': scaled_sigmoid}

    os.environ['CUDA_VISIBLE_DEVICES'] = '-1'  # the driver only builds the model
    named = [Input(shape=(1,), name=column) for column in all_cols]
    by_name = dict(zip(all_cols, named))
    vectors = [Embedding(len(vocabulary[column]), 8, name=f'{column}_vector')(by_name[column])
               for column in CATEGORICAL]
    amounts = BatchNormalization()(Concatenate()([Reshape((1, 1), name=f'{column}_step')(by_name[column])
                                                  for column in CONTINUOUS]))
    hidden = Flatten()(Concatenate()(vectors + [amounts]))
    for units in (args.width, args.width, args.width // 2):
        hidden = Dense(units, activation='relu', kernel_regularizer=tf.keras.regularizers.l2(5e-5))(hidden)
    log_sales = Dense(1, activation=scaled_sigmoid)(Dropout(0.3)(hidden))
    model = tf.keras.Model(named, log_sales)
    model.summary()

    if LEGACY:  # Keras 2 code as it was written: tf_keras takes lr= (and warns)
        opt = tf.keras.optimizers.Adam(lr=args.learning_rate, epsilon=1e-3)
    else:
        opt = tf.keras.optimizers.Adam(learning_rate=args.learning_rate, epsilon=1e-3)
    best = BestModelCheckpoint(monitor='val_exp_rmspe', mode='min', save_freq='epoch')

    store = Store.create(args.work_dir)
    backend = SparkBackend(num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    keras_estimator = hvd.KerasEstimator(backend=backend, store=store, model=model, optimizer=opt, loss='mae',
                                         metrics=[exp_rmspe], custom_objects=custom_objects,
                                         feature_cols=all_cols, label_cols=['Sales'], validation='Validation',
                                         batch_size=args.batch_size, val_batch_size=args.val_batch_size,
                                         epochs=args.epochs, verbose=2,
                                         checkpoint_callback=best)
    keras_model = keras_estimator.fit(train_df).setOutputCols(['Sales_output'])

    history = keras_model.getHistory()
    print('Validation RMSPE by epoch: %s' % ', '.join('%f' % v for v in history['val_exp_rmspe']))
    print('Lowest validation RMSPE: %f' % min(history['val_exp_rmspe']))
    print('Trained with: %s' % type(keras_model.getModel()).__module__.split('.')[0])

    # The model kept (BestModelCheckpoint's best epoch) scored again on the validation rows, in one
    # pass over them all: the history's value is the mean of the ranks' per-batch errors, so the two
    # differ by that averaging only.
    checked = keras_model.transform(train_df.filter(train_df.Validation)).select('Sales', 'Sales_output').toPandas()
    sales, predicted = np.exp(checked.Sales.to_numpy()), np.exp(checked.Sales_output.to_numpy())
    counted = checked.Sales.to_numpy() > 0.001
    print('Kept model re-scored, validation RMSPE: %f' % np.sqrt(np.mean(((sales - predicted) / sales)[counted] ** 2)))

    stage_path = os.path.join(args.output_dir, 'sales-model')
    keras_model.save(stage_path)
    print('Saved the model stage to %s' % stage_path)

    scored = keras_model.transform(test_df)
    forecast = scored.select(F.col('Id').cast('int').alias('Id'), F.exp('Sales_output').alias('Sales_pred'))
    predictions = forecast.orderBy('Id').toPandas()  # back from the log domain
    predictions.to_csv(os.path.join(args.output_dir, 'forecast.csv'), index=False)
    print('Forecast %d rows' % len(predictions))

    # What was saved loads back and scores the same, alone and inside a Pipeline.
    by_id = dict(zip(predictions.Id, predictions.Sales_pred))

    def same(stage):
        rows = stage.transform(test_df).select('Id', 'Sales_output').collect()
        return len(rows) == len(by_id) and all(np.isclose(np.exp(r.Sales_output), by_id[int(r.Id)], rtol=1e-6)
                                               for r in rows)

    print('Loaded model stage scores the same: %s' % same(hvd.KerasModel.load(stage_path)))
    pipeline_path = os.path.join(args.output_dir, 'sales-pipeline')
    PipelineModel(stages=[keras_model]).write().overwrite().save(pipeline_path)
    print('Loaded pipeline scores the same: %s' % same(PipelineModel.load(pipeline_path)))
    estimator_path = os.path.join(args.output_dir, 'sales-estimator')
    keras_estimator.write().overwrite().save(estimator_path)
    loaded = hvd.KerasEstimator.load(estimator_path)
    print('Loaded estimator: optimizer %s.%s, model %s' % (
        type(loaded.getOptimizer()).__module__.split('.')[0], type(loaded.getOptimizer()).__name__,
        type(loaded.getModel()).__module__.split('.')[0]))

    spark.stop()
