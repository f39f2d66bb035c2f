#!/usr/bin/env python
"""Training samples/s of Keras 3 on JAX under ``DataParallel`` next to Keras 3 on TensorFlow with
``sparktrain.keras.DistributedOptimizer``: the same model, data and global batch, 3 ranks each, one
after the other in this invocation, each as one ``sparktrain.run`` on the same Spark session.

- ``JAX DataParallel``: ``run(..., backend="jax")``; ``keras.distribution.initialize()`` and
  ``DataParallel(auto_shard_dataset=False)``; each rank feeds its share of every global batch from a
  ``keras.utils.PyDataset`` (XLA's gloo reduces the gradients);
- ``TF DistributedOptimizer``: the TensorFlow backend, ``DistributedOptimizer(Adam)`` and the
  broadcast callback; each rank fits its shard ``x[rank::size]`` with the per-rank batch (the
  native engine reduces the gradients).

The data are the bundled 8x8 digits (``sparktrain.cli.demo.digits``) tiled ``--repeat-data`` times and
cut to whole global batches; the model an MLP (64-256-256-10). A callback in rank 0 times each epoch;
the first (compiling, warming up) is dropped and the median of the rest gives samples/s. Ratio:
JAX's samples/s over TensorFlow's, measured in this run.

    python benchmarks/jax_throughput.py [--epochs 4 --repeat-data 20 --global-batch 96] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from common import failed, machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- jax_throughput:begin -->"
SECTION_END = "<!-- jax_throughput:end -->"
HEADER = ["contender", "ranks", "global batch", "steps/epoch", "epoch s (median)", "samples/s", "ratio to TF"]


def train(backend: str, repeat: int, global_batch: int, epochs: int):
    """One rank: fit the MLP, return rank 0's epoch times and the steps per epoch."""
    import time

    import keras
    import numpy as np

    import sparktrain
    import sparktrain.keras as hvd
    from sparktrain.cli.demo import digits

    hvd.init()  # first: on JAX, layers made before it would draw their seeds before Keras agrees on one
    (x, y), _ = digits()
    x, y = np.tile(x, (repeat, 1)).astype(np.float32), np.tile(y, repeat).astype(np.int32)
    n = len(x) // global_batch * global_batch
    x, y = x[:n], y[:n]
    rank, size = sparktrain.rank(), sparktrain.size()
    local = global_batch // size
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    layers = [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(256, activation="relu"),
              keras.layers.Dense(10)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = n // global_batch
    if backend == "jax":
        keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))

        class Part(keras.utils.PyDataset):
            def __len__(self):
                return steps

            def __getitem__(self, i):
                rows = slice(i * global_batch + rank * local, i * global_batch + (rank + 1) * local)
                return x[rows], y[rows]

        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(0.001), loss)
        model.fit(Part(), epochs=epochs, verbose=0, callbacks=[Timer()])
    else:
        model = keras.Sequential(layers)
        model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.001)), loss)
        model.fit(x[rank::size], y[rank::size], batch_size=local, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Timer()])
    return {"times": times, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-proc", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat-data", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--xla-flags", default="", help="XLA_FLAGS for the JAX ranks, e.g. "
                        "'--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'")
    parser.add_argument("--only", choices=("jax", "tensorflow"), help="run one contender (no ratio)")
    parser.add_argument("--write", help="results file to put this benchmark's section into")
    args = parser.parse_args()
    import sparktrain
    from sparktrain.driver import cluster

    master = f"local[{args.num_proc}]"
    spark = cluster.start_session(master)
    rows, rates = [], {}
    for name, backend in (("TF DistributedOptimizer", "tensorflow"), ("JAX DataParallel", "jax")):
        if args.only not in (None, backend):
            continue
        env = {"TF_CPP_MIN_LOG_LEVEL": "3", **({"XLA_FLAGS": args.xla_flags} if args.xla_flags else {})}
        settle()
        try:
            got = sparktrain.run(train, args=(backend, args.repeat_data, args.global_batch, args.epochs),
                                 num_proc=args.num_proc, backend=backend, verbose=0, env=env)
        except Exception as e:  # noqa: BLE001 - the other contender still runs
            rows.append([name, failed(name, e)])
            continue
        epoch = statistics.median(got["times"][1:] or got["times"])
        rates[backend] = got["steps"] * args.global_batch / epoch
        rows.append([name, str(args.num_proc), str(args.global_batch), str(got["steps"]), f"{epoch:.3f}",
                     f"{rates[backend]:.0f}"])
    for row in rows:
        if len(row) == len(HEADER) - 1:
            backend = "jax" if row[0].startswith("JAX") else "tensorflow"
            row.append(f"{rates[backend] / rates['tensorflow']:.2f}" if "tensorflow" in rates else "n/a")
    print(text_table(HEADER, rows))
    spark.stop()
    if args.write:
        machine = machine_line(["tensorflow", "keras", "jax", "jaxlib"], master)
        intro = ("Samples/s of one MLP (64-256-256-10) on the digits tiled, the same global batch on 3 ranks: Keras 3 "
                 "on JAX under keras.distribution.DataParallel against Keras 3 on TensorFlow with "
                 "DistributedOptimizer; the median epoch after the first.")
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Keras 3 on JAX against TensorFlow", intro, machine,
                      "python benchmarks/jax_throughput.py " + shlex.join(sys.argv[1:]), HEADER, rows)
    return 0 if len(rates) == (1 if args.only else 2) else 1


if __name__ == "__main__":
    sys.exit(main())
