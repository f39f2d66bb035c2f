#!/usr/bin/env python
"""Training samples/s of Keras 3 on JAX next to Keras 3 on TensorFlow with
``sparktrain.keras.DistributedOptimizer``, each contender one ``sparktrain.run`` on the same Spark
session, one after the other in this invocation.

The same global batch (``--global-batch``) on ``--num-proc`` ranks:

- ``TF DistributedOptimizer``: the TensorFlow backend, ``DistributedOptimizer(Adam)`` and the
  broadcast callback (the native engine reduces the gradients, in sparktrain's TensorFlow kernels);
- ``JAX DataParallel``: ``keras.distribution.initialize()`` and ``DataParallel(auto_shard_dataset=False)``
  (XLA reduces each gradient with its own gloo collective);
- ``JAX DistributedOptimizer``: the JAX backend, ``sparktrain.keras.DistributedOptimizer(Adam)`` and the
  broadcast callback, no ``keras.distribution`` (one fused buffer a step through the native engine).

Weak scaling (``--weak-ranks`` ranks, each with the one-process batch ``--global-batch``): ``JAX one
process`` (1 rank), ``JAX DistributedOptimizer (weak)``, and its ceiling ``JAX alone x N``: the same
ranks each training by itself, never waiting for another.

Each rank feeds its own rows of the bundled 8x8 digits (``sparktrain.cli.demo.digits``) tiled
``--repeat-data`` times; the model is an MLP (64-256-256-10). A callback in rank 0 times each epoch;
the first (compiling, warming up) is dropped and the median of the rest gives samples/s (every
rank's rows). Ratios: over the TensorFlow contender's samples/s, and (weak scaling) over one JAX
process's, measured in this run.

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
HEADER = ["contender", "ranks", "batch per rank", "steps/epoch", "epoch s (median)", "samples/s", "ratio"]
#: name, backend, mode, whether each rank keeps the whole --global-batch (weak scaling), ranks (None: --num-proc;
#: "weak": --weak-ranks; or a number)
CONTENDERS = (
    ("TF DistributedOptimizer", "tensorflow", "engine", False, None),
    ("JAX DataParallel", "jax", "data_parallel", False, None),
    ("JAX DistributedOptimizer", "jax", "engine", False, None),
    ("JAX one process", "jax", "alone", True, 1),
    ("JAX DistributedOptimizer (weak)", "jax", "engine", True, "weak"),
    ("JAX alone x N (ceiling)", "jax", "alone", True, "weak"),
)


def train(backend: str, mode: str, repeat: int, local: int, epochs: int):
    """One rank: fit the MLP on batches of ``local`` rows; return rank 0's epoch times and steps."""
    import time

    import keras
    import numpy as np

    import sparktrain
    import sparktrain.keras as hvd
    from sparktrain.cli.demo import digits

    hvd.init()  # first: on JAX, layers made before it would draw their seeds before Keras agrees on one
    (x, y), _ = digits()
    x, y = np.tile(x, (repeat, 1)).astype(np.float32), np.tile(y, repeat).astype(np.int32)
    rank, size = sparktrain.rank(), sparktrain.size()
    steps = len(x) // (local * size)
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    class Part(keras.utils.PyDataset):
        """This rank's rows of each step's global batch."""

        def __len__(self):
            return steps

        def __getitem__(self, i):
            rows = slice((i * size + rank) * local, (i * size + rank + 1) * local)
            return x[rows], y[rows]

    if mode == "data_parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    callbacks = [Timer()]
    if mode == "engine":
        model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.001)), loss)
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    else:
        model.compile(keras.optimizers.Adam(0.001), loss)
    if backend == "jax":
        model.fit(Part(), epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    else:
        part = np.concatenate([np.arange((i * size + rank) * local, (i * size + rank + 1) * local)
                               for i in range(steps)])
        model.fit(x[part], y[part], batch_size=local, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return {"times": times, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-proc", type=int, default=3)
    parser.add_argument("--weak-ranks", type=int, default=2, help="ranks of the weak-scaling rows (0: none)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat-data", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--xla-flags", default="", help="XLA_FLAGS for the JAX ranks, e.g. "
                        "'--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="more environment for every rank (repeatable), e.g. JAX_CPU_ENABLE_ASYNC_DISPATCH=0")
    parser.add_argument("--only", help="comma-separated contender names to run (default: all)")
    parser.add_argument("--write", help="results file to put this benchmark's section into")
    args = parser.parse_args()
    import sparktrain
    from sparktrain.driver.launch import cluster

    master = f"local[{max(args.num_proc, args.weak_ranks)}]"
    spark = cluster.start_session(master)
    rows, rates = [], {}
    for name, backend, mode, weak, ranks in CONTENDERS:
        if args.only and name not in args.only.split(","):
            continue
        n = args.num_proc if ranks is None else args.weak_ranks if ranks == "weak" else ranks
        if n < 1:
            continue
        local = args.global_batch if weak else args.global_batch // n
        env = {"TF_CPP_MIN_LOG_LEVEL": "3", **({"XLA_FLAGS": args.xla_flags} if args.xla_flags else {}),
               **dict(kv.split("=", 1) for kv in args.env)}
        settle()
        try:
            got = sparktrain.run(train, args=(backend, mode, args.repeat_data, local, args.epochs),
                                 num_proc=n, backend=backend, verbose=0, env=env)
        except Exception as e:  # noqa: BLE001 - the other contenders still run
            rows.append([name, failed(name, e)])
            continue
        epoch = statistics.median(got["times"][1:] or got["times"])
        rates[name] = got["steps"] * local * n / epoch
        rows.append([name, str(n), str(local), str(got["steps"]), f"{epoch:.3f}", f"{rates[name]:.0f}"])
    for row in rows:
        if len(row) == len(HEADER) - 1:
            weak = row[0] in ("JAX one process", "JAX DistributedOptimizer (weak)", "JAX alone x N (ceiling)")
            base = "JAX one process" if weak else "TF DistributedOptimizer"
            row.append(f"{rates[row[0]] / rates[base]:.2f} of {'one JAX' if weak else 'TF'}" if base in rates
                       else "n/a")
    print(text_table(HEADER, rows))
    spark.stop()
    if args.write:
        machine = machine_line(["tensorflow", "keras", "jax", "jaxlib"], master)
        intro = ("Samples/s of one MLP (64-256-256-10) on the digits tiled. The same global batch on "
                 f"{args.num_proc} ranks: Keras 3 on TensorFlow with DistributedOptimizer, Keras 3 on JAX under "
                 "keras.distribution.DataParallel, and Keras 3 on JAX with sparktrain.keras.DistributedOptimizer "
                 "(ratio: over TF). Weak scaling: each rank keeps the one-process batch (ratio: over one JAX "
                 "process). The median epoch after the first.")
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Keras 3 on JAX against TensorFlow", intro, machine,
                      "python benchmarks/jax_throughput.py " + shlex.join(sys.argv[1:]), HEADER, rows)
    return 0 if len(rates) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
