#!/usr/bin/env python
"""The feed at scale: time to the first batch, steady rows/s and local disk for ``run(data=df)``,
at several table sizes, against the in-memory ceiling and the peers, in one run.

Every contender is one ``sparktrain.run`` on 2 ranks of ``local[2]``, so what differs is only how
rows reach ``model.fit``. The model is trivial (one Dense unit, a plain optimizer, no
collective), so feeding dominates. Each rank measures:
- time to first batch: from the driver calling ``run`` to rank 0's first training batch;
- steady state: the rows of epochs 2.. divided by their time, summed over the ranks;
- peak local disk: the rank's data directory (spool or cache), sampled every 0.2 s.

Contenders, at each size of ``--rows`` (Parquet tables of 16 float features written by Spark):
- ``data=df`` of the table (a Parquet scan: the ranks read their row groups, cache under
  ``--cache-limit``);
- ``data=df`` of a plan that is not a plain scan (a filter that keeps every row: one shuffle and a
  spool), at the sizes up to ``--peer-rows``;
- pyarrow per rank: each rank reads ``files[rank::2]`` into memory, then ``fit(x, y)``, up to
  ``--peer-rows``;
- in-memory numpy (the ceiling): each rank makes its share with numpy, at each size (a random
  gather's cost grows with the rows it picks from, in memory as from a memory-mapped file).

    python benchmarks/feed_throughput.py [--rows 1000000,10000000,50000000] [--cache-limit 512m]
        [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import failed, machine_line, settle, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- feed_throughput:begin -->"
SECTION_END = "<!-- feed_throughput:end -->"
FEATURES = 16
RANKS = 2


def _disk(directory: str) -> int:
    total = 0
    for d, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def watch_disk() -> dict:
    """In a rank: the peak bytes of its data directory, sampled every 0.2 s until ``stop`` is set."""
    box = {"peak": 0, "stop": threading.Event()}
    directory = os.environ.get("SPARKTRAIN_DATA_DIR")

    def loop():
        while directory and not box["stop"].wait(0.2):
            box["peak"] = max(box["peak"], _disk(directory))

    threading.Thread(target=loop, daemon=True).start()
    return box


def fit_and_time(source, started: float, epochs: int, batch_size: int):
    """In a rank: fit the trivial model on ``source`` (a dataset or ``(x, y)``); return timings."""
    import keras

    disk = watch_disk()
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
        rows_per_epoch = len(x) // batch_size * batch_size
    else:
        model.fit(source, epochs=epochs, verbose=0, callbacks=[Clock()])
        rows_per_epoch = int(source.cardinality()) * batch_size
    disk["stop"].set()
    steady = times[-1] - times[1]
    return {"first": first[0] - started, "rows_per_s": rows_per_epoch * (epochs - 1) / steady, "disk": disk["peak"]}


def with_data(started, epochs, batch_size):
    import sparktrain.data

    ds = sparktrain.data.dataset("x", label="y", batch_size=batch_size, seed=0)
    got = fit_and_time(ds, started, epochs, batch_size)
    s = sparktrain.data.shard()
    cache = getattr(s, "cache", None)
    got["limit"] = cache.limit if cache is not None else None
    got["row_group"] = max(p.nbytes for p in s.pieces) if cache is not None else 0
    return got


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
    t = pq.read_table(files, columns=["x", "y"])
    x = t.column("x").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES)
    y = t.column("y").to_numpy()
    return fit_and_time((np.ascontiguousarray(x), y), started, epochs, batch_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,10000000,50000000")
    parser.add_argument("--peer-rows", type=int, default=10_000_000, help="the peers run at sizes up to this")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--cache-limit", default="512m", help="each rank's data_cache_limit")
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args()
    sizes = [int(r) for r in args.rows.split(",")]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import sparktrain
    from sparktrain.driver.launch.cluster import start_session

    master = f"local[{RANKS}]"
    spark = start_session(master)
    from pyspark.sql import functions as F

    work = tempfile.mkdtemp(prefix="feed-bench-")
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "SPARKTRAIN_DATA_CACHE_LIMIT": args.cache_limit}
    b, e = args.batch_size, args.epochs
    results: list[tuple[int, str, dict | str]] = []

    def measure(rows: int, name: str, go) -> None:
        settle()
        try:
            got = go(time.time())  # rank 0's numbers; every rank runs the same loop
            got = {**got, "rows_per_s": got["rows_per_s"] * RANKS}
        except Exception as exc:  # noqa: BLE001 - one contender failing must not stop the others
            got = failed(name, exc)
        results.append((rows, name, got))
        print(rows, name, got, flush=True)

    for rows in sizes:
        table = os.path.join(work, f"table-{rows}")
        spark.range(0, rows, 1, 6).select(
            F.array(*[F.rand(i).cast("float") for i in range(FEATURES)]).alias("x"),
            F.rand(99).cast("float").alias("y")).write.parquet(table)
        df = spark.read.parquet(table)
        # At each size: a random gather's cost grows with the rows it picks from.
        measure(rows, "in-memory numpy (ceiling)",
                lambda t: sparktrain.run(in_memory, args=(t, e, b, rows), num_proc=RANKS, env=env, verbose=0))
        measure(rows, "data=df, Parquet scan (sparktrain)",
                lambda t: sparktrain.run(with_data, args=(t, e, b), num_proc=RANKS, env=env, verbose=0, data=df))
        if rows <= args.peer_rows:
            shuffled = df.where(F.abs(F.col("y")) >= 0)  # every row; a function the ranks do not evaluate
            measure(rows, "data=df, other plan (one shuffle, spool)",
                    lambda t: sparktrain.run(with_data, args=(t, e, b), num_proc=RANKS, env=env, verbose=0,
                                             data=shuffled))
            measure(rows, "pyarrow, files[rank::2] in memory",
                    lambda t: sparktrain.run(pyarrow_files, args=(t, e, b, table), num_proc=RANKS, env=env,
                                             verbose=0))
        shutil.rmtree(table, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)

    # The ceiling of a size: its fastest in-memory contender (numpy made in the rank, or pyarrow's
    # files read into memory); both fit numpy arrays, and a neighbour's load moves either.
    ceilings: dict[int, dict] = {}
    for r, n, g in results:
        if (n.startswith("in-memory") or "in memory" in n) and isinstance(g, dict):
            if r not in ceilings or g["rows_per_s"] > ceilings[r]["rows_per_s"]:
                ceilings[r] = g
    first_small = next((g["first"] for r, n, g in results if n.startswith("data=df, Parquet") and r == sizes[0]
                        and isinstance(g, dict)), None)
    header = ["rows", "contender", "steady rows/s (2 ranks)", "vs in-memory ceiling", "first batch (s)",
              "vs first at smallest", "peak disk per rank (MiB)", "cache limit + a row group (MiB)"]
    table_rows = []
    for rows, name, got in results:
        if isinstance(got, str):
            table_rows.append([f"{rows:,}", name, got])
            continue
        ratio = got["rows_per_s"] / ceilings[rows]["rows_per_s"] if rows in ceilings else float("nan")
        vs_first = f"{got['first'] / first_small:.2f}x" if first_small and "Parquet" in name else ""
        bound = (f"{(got['limit'] + got['row_group']) / 2**20:,.0f}" if got.get("limit") is not None else "")
        table_rows.append([f"{rows:,}", name, f"{got['rows_per_s']:,.0f}", f"{ratio:.2f}x", f"{got['first']:.1f}",
                           vs_first, f"{got['disk'] / 2**20:,.0f}", bound])
    machine = machine_line(["tensorflow", "pyarrow"], master)
    print(machine)
    print(text_table(header, table_rows))
    if args.write:
        intro = (f"`run(data=df)` at {', '.join(f'{r:,}' for r in sizes)} rows of {FEATURES} float features "
                 f"(Parquet written by Spark in 6 files), {RANKS} ranks, batch {b} per rank, {e} epochs, each "
                 f"rank's `data_cache_limit` {args.cache_limit}. A one-unit Dense model, no collective, so "
                 "feeding dominates. Steady state is epochs 2.., summed over the ranks; the first batch is "
                 "timed from the driver's `run` call to rank 0's first batch (launch included); peak disk is "
                 "rank 0's data directory (cache or spool), sampled every 0.2 s. The in-memory ceiling runs "
                 "at each size, and each row's ratio is to the ceiling of its size: the faster of the two in-memory "
                 "contenders there (numpy made in the rank, pyarrow's files read into memory; both fit numpy "
                 "arrays). One run, one session.")
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "The feed at scale", intro, machine,
            f"python benchmarks/feed_throughput.py --rows {args.rows} --cache-limit {args.cache_limit} "
            "--write benchmarks/RESULTS.md", header, table_rows)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
