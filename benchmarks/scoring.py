#!/usr/bin/env python
"""Scoring throughput: rows per second of ``KerasModel.transform`` over a 1 M-row DataFrame, and its baselines.

One model (a small MLP, 64 features in, 10 probabilities out) in one store, scored three ways in
the same invocation:
- ``KerasModel.transform``: ``predict_batch_udf``, the model loaded once per Python worker; run
  twice, since the first run's Python workers import TensorFlow first;
- a hand-written ``pandas_udf`` that loads the model from the store in every batch, as scoring
  code often does;
- ``mapInArrow`` with no model: Arrow batches to a Python worker, stacked into numpy, a
  prediction-sized column back (in started workers with no TensorFlow, and again in workers
  that have scored);
- a ``pandas_udf`` that takes the same rows and returns zeros, with no model: the floor of
  the pandas path (Arrow to pandas to numpy and back);
- the model's own ``predict`` on the same rows, as numpy, in one process kept to one core (its
  affinity and TensorFlow's thread pools set to one), the ceiling per core; and the same process
  free to use every core, for reference.

The Spark contenders run on ``local[N]`` (N = the cores used) and write every prediction to a
noop sink, so the whole column is computed. The ceiling per core is the no-model Arrow path and
one process's ``predict`` on one core in series (1 / (1/arrow + 1/predict)); the target: transform's
rows/s per core at least 0.8 of it.

    python benchmarks/scoring.py [--rows 1000000] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import pandas as pd

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine_line, nproc, settle, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- scoring:begin -->"
SECTION_END = "<!-- scoring:end -->"
FEATURES = 64


def _model(hidden: int):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10, activation="softmax")])


def _per_batch_udf(url):
    """The naive baseline: every Arrow batch loads the model again."""
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("array<float>")
    def score(x: pd.Series) -> pd.Series:
        import numpy as np

        from sparktrain.ml.model import load

        model = load(url)
        out = model.predict_on_batch(np.stack(x.to_numpy()).astype("float32"))
        return pd.Series(list(out))

    return score


def _floor_udf():
    """The Python worker path alone: the same rows in, a prediction-sized array out, no model."""
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("array<float>")
    def floor(x: pd.Series) -> pd.Series:
        import numpy as np

        rows = np.vstack(x.to_numpy())
        return pd.Series(list(np.zeros((len(rows), 10), np.float32)))

    return floor


def _arrow_floor(df):
    """Spark's Arrow path with no model: Arrow batches from the JVM to a Python worker, each feature
    column stacked into one numpy array, a prediction-sized column back (``mapInArrow``)."""
    from pyspark.sql.types import ArrayType, FloatType, StructField, StructType

    def floor(batches):
        import numpy as np
        import pyarrow as pa

        from sparktrain.ml.scoring import list_to_numpy, predictions_to_arrow

        for b in batches:
            x = list_to_numpy(b.column("x"), [FEATURES], "x")
            yield pa.RecordBatch.from_arrays([predictions_to_arrow(np.zeros((len(x), 10), np.float32), len(x), False)],
                                             names=["out"])

    return df.select("x").mapInArrow(floor, StructType([StructField("out", ArrayType(FloatType()))]))


_PREDICT = """
import os, sys, time
pinned, url, rows, batch = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if pinned:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
import numpy as np
import tensorflow as tf
if pinned:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
from sparktrain.ml.model import load
model = load(url)
x = np.random.default_rng(0).random((rows, %d), dtype=np.float32)
model.predict(x[:batch], batch_size=batch, verbose=0)
start = time.perf_counter()
model.predict(x, batch_size=batch, verbose=0)
print(time.perf_counter() - start)
"""


def _predict_seconds(url: str, rows: int, batch_size: int, pinned: bool) -> float:
    """``model.predict`` on ``rows`` rows in a fresh process, kept to one core when ``pinned``."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _PREDICT % FEATURES, "1" if pinned else "0", url, str(rows),
                          str(batch_size)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(spark, df, store: str, hidden: int, rows: int, batch_size: int, cores: int,
            arrow_per_core: float) -> tuple[list, float, float]:
    """One model's table rows; transform's warm rows/s per core against one process's predict, and
    against the ceiling: the no-model Arrow path and predict, per core, in series."""
    from sparktrain import storage
    from sparktrain.ml import KerasModel
    from sparktrain.ml.portable import keras_bytes

    model = _model(hidden)
    url = storage.put_bytes(f"file://{store}/model-{hidden}.keras", keras_bytes(model))  # committed, as fit writes it
    scored_model = KerasModel(model_url=url, feature_cols=["x"], label_cols=["y"], batch_size=batch_size)

    def transform():
        scored_model.transform(df).select("y__output").write.format("noop").mode("overwrite").save()

    settle()
    t_cold = _timed(transform)  # each Python worker imports TensorFlow first, unless an earlier model's did
    settle()
    t_warm = _timed(transform)  # the same workers again; the model is loaded again, once per worker
    settle()
    t_naive = _timed(lambda: df.select(_per_batch_udf(url)("x")).write.format("noop").mode("overwrite").save())
    settle()
    t_predict = _predict_seconds(url, rows, batch_size, pinned=True)
    settle()
    t_free = _predict_seconds(url, rows, batch_size, pinned=False)
    settle()
    t_arrow_warm = _timed(lambda: _arrow_floor(df).write.format("noop").mode("overwrite").save())
    per_core = rows / t_predict
    ceiling = 1.0 / (1.0 / arrow_per_core + 1.0 / per_core)
    label = f"{FEATURES}-{hidden}-{hidden}-10"
    out = []
    for name, seconds, used in (("KerasModel.transform, first run", t_cold, cores),
                                ("KerasModel.transform, again (warm workers)", t_warm, cores),
                                ("pandas_udf, model loaded per batch", t_naive, cores),
                                ("mapInArrow, no model, workers that scored", t_arrow_warm, cores),
                                ("model.predict, one process on one core", t_predict, 1),
                                ("model.predict, one process on every core", t_free, cores)):
        rate = rows / seconds
        out.append([label, name, f"{seconds:.1f}", f"{rate:,.0f}", str(used), f"{rate / used / per_core:.2f}x",
                    f"{rate / used / ceiling:.2f}"])
    out.append([label, "ceiling: no-model Arrow path and predict in series, per core", "", f"{ceiling:,.0f}", "1",
                f"{ceiling / per_core:.2f}x", "1.00"])
    return out, rows / t_warm / cores / per_core, rows / t_warm / cores / ceiling


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    with tempfile.TemporaryDirectory(prefix="sparktrain-scoring-") as store:
        return _bench(args, store)


def _bench(args, store):
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    cores = nproc()
    master = f"local[{cores}]"
    spark = (SparkSession.builder.master(master).appName("sparktrain-scoring")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    table = os.path.join(store, "rows.parquet")
    spark.range(args.rows, numPartitions=cores * 4).select(
        F.col("id"), F.array(*[F.rand(seed=j).cast("float") for j in range(FEATURES)]).alias("x")
    ).write.parquet(table)
    df = spark.read.parquet(table)
    settle()
    _timed(lambda: _arrow_floor(df).write.format("noop").mode("overwrite").save())  # starts the Python workers
    settle()
    t_arrow = _timed(lambda: _arrow_floor(df).write.format("noop").mode("overwrite").save())  # no TensorFlow in them
    settle()
    t_floor = _timed(lambda: df.select(_floor_udf()("x")).write.format("noop").mode("overwrite").save())
    arrow_per_core = args.rows / t_arrow / cores
    rows = [["(none)", "mapInArrow, no model: Spark's Arrow path (no TensorFlow in the workers)", f"{t_arrow:.1f}",
             f"{args.rows / t_arrow:,.0f}", str(cores), "", ""],
            ["(none)", "pandas_udf, no model: the pandas path's floor", f"{t_floor:.1f}",
             f"{args.rows / t_floor:,.0f}", str(cores), "", ""]]
    targets = []
    for hidden in (128, 1024):
        found, ratio, of_ceiling = measure(spark, df, store, hidden, args.rows, args.batch_size, cores, arrow_per_core)
        rows += found
        targets.append(f"{found[0][0]}: {of_ceiling:.2f} of the ceiling, {ratio:.2f}x predict per core")
    header = ["model", "contender", "seconds", "rows/s", "cores", "rows/s per core vs predict", "vs ceiling"]
    print(text_table(header, rows))
    target = ("Target: transform's rows/s per core (warm workers) >= 0.8 of the ceiling (the no-model Arrow path and "
              "one process's predict on one core, in series): " + "; ".join(targets))
    print(target)
    if args.write:
        machine = machine_line(["sparktrain", "tensorflow", "keras"], master=master)
        intro = (f"{args.rows:,} rows of {FEATURES} float features (an array column), scored by two MLPs, predictions "
                 f"written to a noop sink; prediction batch {args.batch_size}. `model.predict` runs in a process kept to one "
                 "core (affinity and TensorFlow's thread pools); the same process on every core is shown for reference. "
                 "The ceiling per core is the no-model Arrow path (workers started, no TensorFlow in them) and that predict in series. Written by "
                 "`benchmarks/scoring.py`.")
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Scoring throughput", intro, machine,
            f"python benchmarks/scoring.py --rows {args.rows} --write benchmarks/RESULTS.md", header, rows,
            after_table=[target])
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
