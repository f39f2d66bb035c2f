#!/usr/bin/env python
"""Scoring throughput: rows per second of ``KerasModel.transform`` over a 1 M-row DataFrame, and its baselines.

One model (a small MLP, 64 features in, 10 probabilities out) in one store, scored three ways in
the same invocation:
- ``KerasModel.transform``: ``predict_batch_udf``, the model loaded once per Python worker;
- a hand-written ``pandas_udf`` that loads the model from the store in every batch, as scoring
  code often does;
- the model's own ``predict`` on the same rows, as numpy, in one process (the ceiling per core).

The Spark contenders run on ``local[N]`` (N = the cores used) and write every prediction to a
noop sink, so the whole column is computed. The target: transform's rows/s per core at least 0.8x
one process's ``predict``.

    python benchmarks/scoring.py [--rows 1000000] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine_line, markdown_section, nproc, settle, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- scoring:begin -->"
SECTION_END = "<!-- scoring:end -->"
FEATURES = 64


def _model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")])


def _per_batch_udf(url):
    """The naive baseline: every Arrow batch loads the model again."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("array<float>")
    def score(x: pd.Series) -> pd.Series:
        import numpy as np

        from sparktrain.ml.model import load

        model = load(url)
        out = model.predict_on_batch(np.stack(x.to_numpy()).astype("float32"))
        return pd.Series(list(out))

    return score


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import numpy as np
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from sparktrain.ml import KerasModel
    from sparktrain.ml.training import keras_bytes

    cores = nproc()
    master = f"local[{cores}]"
    store = tempfile.mkdtemp(prefix="sparktrain-scoring-")
    path = os.path.join(store, "model.keras")
    model = _model()
    with open(path, "wb") as f:
        f.write(keras_bytes(model))
    url = f"file://{path}"
    spark = (SparkSession.builder.master(master).appName("sparktrain-scoring")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    table = os.path.join(store, "rows.parquet")
    spark.range(args.rows, numPartitions=cores * 4).select(
        F.col("id"), F.array(*[F.rand(seed=j).cast("float") for j in range(FEATURES)]).alias("x")
    ).write.parquet(table)
    df = spark.read.parquet(table)
    scored_model = KerasModel(model_url=url, feature_cols=["x"], label_cols=["y"], batch_size=args.batch_size)

    rows = []
    settle()
    t_transform = _timed(lambda: scored_model.transform(df).select("y__output").write.format("noop").mode("overwrite").save())
    settle()
    t_naive = _timed(lambda: df.select(_per_batch_udf(url)("x")).write.format("noop").mode("overwrite").save())
    x = np.random.default_rng(0).random((args.rows, FEATURES), dtype=np.float32)
    settle()
    t_predict = _timed(lambda: model.predict(x, batch_size=args.batch_size, verbose=0))
    per_core = args.rows / t_predict
    for name, seconds, used in (("KerasModel.transform", t_transform, cores),
                                ("pandas_udf, model loaded per batch", t_naive, cores),
                                ("model.predict, one process (ceiling per core)", t_predict, 1)):
        rate = args.rows / seconds
        rows.append([name, f"{seconds:.1f}", f"{rate:,.0f}", str(used), f"{rate / used / per_core:.2f}x"])
    header = ["contender", "seconds", "rows/s", "cores", "rows/s per core vs predict"]
    print(text_table(header, rows))
    ratio = args.rows / t_transform / cores / per_core
    target = f"Target: transform's rows/s per core >= 0.8x one process's predict: {ratio:.2f}x, {'yes' if ratio >= 0.8 else 'no'}"
    print(target)
    if args.write:
        machine = machine_line(["sparktrain", "tensorflow", "keras"], master=master)
        intro = (f"{args.rows:,} rows of {FEATURES} float features scored by one MLP (64-128-64-10), predictions "
                 f"written to a noop sink; prediction batch {args.batch_size}. Written by `benchmarks/scoring.py`.")
        write_section(args.write, markdown_section(
            SECTION_BEGIN, SECTION_END, "Scoring throughput", intro, machine,
            f"python benchmarks/scoring.py --rows {args.rows} --write benchmarks/RESULTS.md", header, rows,
            after_table=[target]), SECTION_BEGIN, SECTION_END)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
