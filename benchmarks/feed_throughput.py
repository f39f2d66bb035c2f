#!/usr/bin/env python
"""Feeding throughput: rows per second into ``model.fit`` from a 2 M-row table, ``data=`` and its peers.

Every contender is one ``sparktrain.run`` on 3 ranks of a local Spark, so what differs is only how
the rows reach ``model.fit``. The model is trivial (one Dense unit, a plain optimizer, no
collective), so feeding dominates. Each rank measures:
- time to first batch: from the driver calling ``run`` to rank 0's first training batch;
- steady state: the rows of epochs 2.. divided by their time, summed over the 3 ranks.

Contenders:
- ``data=df``: ``sparktrain.run(..., data=spark.read.parquet(table))`` and
  ``sparktrain.data.dataset("x", label="y", batch_size=B)``;
- in-memory numpy (the ceiling): each rank makes its share of rows with numpy, ``fit(x, y)``;
- pyarrow per rank: each rank reads ``files[rank::3]`` of the table's Parquet files, ``fit(x, y)``;
- petastorm: ``make_spark_converter(df).make_tf_dataset(cur_shard=rank, shard_count=3)``, if it
  imports and runs with this pyspark and pyarrow.

    python benchmarks/feed_throughput.py [--rows 2000000] [--epochs 4] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import failed, machine_line, settle, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- feed_throughput:begin -->"
SECTION_END = "<!-- feed_throughput:end -->"
FEATURES = 16
RANKS = 3


def fit_and_time(source, started: float, epochs: int, batch_size: int, steps=None):
    """In a rank: fit the trivial model on ``source`` (a dataset or ``(x, y)``); return timings."""
    import keras

    times: list[float] = []
    first: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not first:
                first.append(time.time())

        def on_epoch_begin(self, epoch, logs=None):
            times.append(time.perf_counter())

        def on_train_end(self, logs=None):
            times.append(time.perf_counter())

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    if isinstance(source, tuple):
        x, y = source
        model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=True, callbacks=[Clock()])
        rows_per_epoch = len(x)
    else:
        model.fit(source, epochs=epochs, verbose=0, callbacks=[Clock()], steps_per_epoch=steps)
        rows_per_epoch = (steps or int(source.cardinality())) * batch_size
    steady = times[-1] - times[1]
    return {"first": first[0] - started, "rows_per_s": rows_per_epoch * (epochs - 1) / steady}


def with_data(started, epochs, batch_size):
    import sparktrain.data

    ds = sparktrain.data.dataset("x", label="y", batch_size=batch_size, seed=0)
    return fit_and_time(ds, started, epochs, batch_size)


def in_memory(started, epochs, batch_size, rows):
    import numpy as np

    import sparktrain

    n = rows // RANKS
    rng = np.random.default_rng(sparktrain.rank())
    x, y = rng.random((n, FEATURES), dtype=np.float32), rng.random(n, dtype=np.float32)
    return fit_and_time((x, y), started, epochs, batch_size)


def pyarrow_files(started, epochs, batch_size, table):
    import numpy as np
    import pyarrow.parquet as pq

    import sparktrain

    files = sorted(glob.glob(os.path.join(table, "*.parquet")))[sparktrain.rank()::sparktrain.size()]
    t = pq.read_table(files, columns=["x", "y"]) if files else None
    x = t.column("x").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES)
    y = t.column("y").to_numpy()
    # Shards of unequal size would run unequal steps; with no collective in the step that only
    # shows as one rank finishing first, which the steady-state rate already accounts for.
    return fit_and_time((np.ascontiguousarray(x), y), started, epochs, batch_size)


def petastorm_rank(started, epochs, batch_size, converter):
    import sparktrain

    steps = len(converter) // (batch_size * RANKS)
    with converter.make_tf_dataset(batch_size=batch_size, cur_shard=sparktrain.rank(), shard_count=RANKS,
                                   num_epochs=None, workers_count=1) as ds:
        ds = ds.map(lambda row: (row.x, row.y))
        return fit_and_time(ds, started, epochs, batch_size, steps=steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import sparktrain
    from sparktrain.driver.launch.cluster import start_session

    master = f"local[{RANKS}]"
    spark = start_session(master)
    from pyspark.sql import functions as F

    work = tempfile.mkdtemp(prefix="feed-bench-")
    table = os.path.join(work, "table")
    spark.range(0, args.rows, 1, 6).select(
        F.array(*[F.rand(i).cast("float") for i in range(FEATURES)]).alias("x"),
        F.rand(99).cast("float").alias("y")).write.parquet(table)
    df = spark.read.parquet(table)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    b, e = args.batch_size, args.epochs

    def petastorm_run(started):
        from petastorm.spark import SparkDatasetConverter, make_spark_converter

        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + os.path.join(work, "petastorm"))
        converter = make_spark_converter(df)
        try:
            return sparktrain.run(petastorm_rank, args=(started, e, b, converter), num_proc=RANKS, env=env, verbose=0)
        finally:
            converter.delete()

    contenders = [
        ("in-memory numpy (ceiling)", lambda t: sparktrain.run(in_memory, args=(t, e, b, args.rows), num_proc=RANKS,
                                                              env=env, verbose=0)),
        ("data=df (sparktrain)", lambda t: sparktrain.run(with_data, args=(t, e, b), num_proc=RANKS, env=env,
                                                         verbose=0, data=df)),
        ("pyarrow, files[rank::3] per rank", lambda t: sparktrain.run(pyarrow_files, args=(t, e, b, table),
                                                                     num_proc=RANKS, env=env, verbose=0)),
        ("petastorm make_spark_converter", petastorm_run),
    ]
    results: dict[str, dict | str] = {}
    for name, go in contenders:
        settle()
        try:
            # Rank 0's numbers; the steady rate is per rank, and every rank runs the same loop.
            got = go(time.time())
            results[name] = {"first": got["first"], "rows_per_s": got["rows_per_s"] * RANKS}
        except Exception as exc:  # noqa: BLE001 - one contender failing must not stop the others
            results[name] = failed(name, exc)
    shutil.rmtree(work, ignore_errors=True)

    ceiling = results["in-memory numpy (ceiling)"]
    header = ["contender", "steady rows/s (3 ranks)", "vs in-memory", "time to first batch (s)"]
    rows = []
    for name, got in results.items():
        if isinstance(got, str):
            rows.append([name, got])
            continue
        ratio = got["rows_per_s"] / ceiling["rows_per_s"] if isinstance(ceiling, dict) else float("nan")
        rows.append([name, f"{got['rows_per_s']:,.0f}", f"{ratio:.2f}x", f"{got['first']:.1f}"])
    machine = machine_line(["tensorflow", "pyarrow", "petastorm"], master)
    print(machine)
    print(text_table(header, rows))
    if args.write:
        intro = (f"Rows per second into `model.fit` of a one-unit Dense model (no collective, so feeding "
                 f"dominates), from a {args.rows:,}-row Parquet table of {FEATURES} float features, batch "
                 f"{b} per rank, {e} epochs; steady state is epochs 2-{e}, summed over {RANKS} ranks. Time to "
                 "first batch runs from the driver's `run` call to rank 0's first batch, so it includes the "
                 "launch, and for `data=` the shuffle and the spool. Every contender runs inside "
                 "`sparktrain.run` on the same session.")
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "DataFrame feeding throughput", intro, machine,
            "python benchmarks/feed_throughput.py --write benchmarks/RESULTS.md", header, rows)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
