#!/usr/bin/env python
"""Epoch time of Keras 3 with sparktrain.keras.DistributedOptimizer next to tf_keras under MultiWorkerMirroredStrategy.

Three contenders train the same model on the same data with the same global batch, one after
the other in this invocation, each as one ``sparktrain.run``:

- ``DistributedOptimizer (Keras 3)``: ``--num-proc`` ranks (default 3), Keras 3 with
  ``sparktrain.keras.DistributedOptimizer(Adam)``, ``BroadcastGlobalVariablesCallback(0)`` and
  ``MetricAverageCallback()``; each rank trains on its shard ``x[rank::size]`` with batch
  ``global_batch / size``;
- ``tf_keras strategy``: the same ranks, tf_keras (``TF_USE_LEGACY_KERAS=1``) under
  ``sparktrain.tensorflow.strategy()`` (a MultiWorkerMirroredStrategy); the same shards and
  per-rank batch, fed through ``strategy.distribute_datasets_from_function``;
- ``one process (Keras 3)``: one rank, Keras 3 with the plain Adam, all the data, the global batch.

The data are scikit-learn's bundled 8x8 digits (``sparktrain.demo.digits``, nothing is
downloaded), tiled ``--repeat-data`` times and cut to a whole number of global batches, so every
contender runs the same steps per epoch on the same samples. Every rank feeds its data through
the same in-memory ``tf.data`` pipeline (slices, batch, repeat, prefetch; no shuffling). The model is
``sparktrain.demo.build_cnn``'s CNN (or an MLP with ``--model mlp``), built layer for layer with
Keras 3 or tf_keras. Every contender compiles with Adam(0.001 x global batch / 32), the loss and the
accuracy metric, without XLA.

A callback inside the ranks takes ``time.perf_counter()`` at ``on_epoch_begin`` and
``on_epoch_end``; rank 0's epoch times come back. The first epoch of each run (tracing, warm-up)
is discarded; the table shows the median of the rest.

    python benchmarks/epoch_time.py [--epochs 6 --repeat-data 10 --rounds 2] [--spark] [--write benchmarks/RESULTS.md]

``--scaling`` measures how CPU training scales instead: one process with 1 thread (once free to
use every core for TensorFlow's inter-op and input threads, once confined to one core, as each
rank is) against 2
ranks with 1 thread each (``OMP_NUM_THREADS`` and TensorFlow's intra-op threads 1, its inter-op
pool 2, as sparktrain's defaults for one CPU per task),
the gradients averaged by the native engine and, separately, by TensorFlow's ring. Twice: with
the same global batch for all (strong scaling: each rank takes half the batch), and with the
same batch per rank (weak scaling, the convention of Horovod's scaling figures: the 2 ranks take
a global batch twice the size, in half the steps per epoch). It reports each one's samples/s and
the ratio to the one process::

    python benchmarks/epoch_time.py --scaling --num-proc 2 --global-batch 64 --write benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
import traceback

from common import machine_line, markdown_section, settle, short_reason, text_table, write_section

SECTION_BEGIN = "<!-- epoch_time:begin -->"
SECTION_END = "<!-- epoch_time:end -->"

OURS = "DistributedOptimizer (Keras 3)"
PEER = "tf_keras strategy"
SINGLE = "one process (Keras 3)"

#: Environment of every rank: TensorFlow's C++ logging off.
BASE_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


# -- what the ranks run (self-contained: cloudpickle ships these functions by value) -------------

def load_data(repeat: int, global_batch: int):
    """The digits training images as (N, 8, 8, 1), tiled ``repeat`` times, cut to whole global batches."""
    import numpy as np

    from sparktrain.demo import digits

    (x, y), _ = digits()
    x = np.tile(x, (repeat, 1))
    y = np.tile(y, repeat)
    n = len(x) // global_batch * global_batch
    return x[:n].reshape(-1, 8, 8, 1), y[:n]


def build_model(k, kind: str):
    """The same layers with Keras 3 (``k`` = keras) or tf_keras (``k`` = tf_keras).

    ``cnn`` is ``sparktrain.demo.build_cnn``'s network.
    """
    if kind == "cnn":
        from sparktrain.demo import build_cnn

        return build_cnn(k)
    layers = [
        k.layers.Flatten(),
        k.layers.Dense(256, activation="relu"),
        k.layers.Dense(128, activation="relu"),
        k.layers.Dense(10, activation="softmax"),
    ]
    return k.Sequential([k.Input((8, 8, 1)), *layers])


def epoch_timer(base):
    """A callback class (subclass of ``base``) that records each epoch's wall time."""

    class EpochTimer(base):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def pipeline(tf, x, y, batch: int):
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
            .prefetch(tf.data.AUTOTUNE))


def train_keras3(kind: str, repeat: int, global_batch: int, epochs: int, lr: float, distributed: bool) -> dict:
    """Keras 3: with DistributedOptimizer on every rank, or the plain optimizer in one process."""
    import keras
    import tensorflow as tf

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = load_data(repeat, global_batch)
    steps = len(x) // global_batch
    x, y = x[r::n], y[r::n]
    model = build_model(keras, kind)
    opt = keras.optimizers.Adam(lr)
    callbacks = []
    if distributed:
        opt = hvd.DistributedOptimizer(opt)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    timer = epoch_timer(keras.callbacks.Callback)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=False)
    history = model.fit(pipeline(tf, x, y, global_batch // n), steps_per_epoch=steps, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[*callbacks, timer])  # the timer last: its epoch end follows the averaging
    return {"epoch_s": timer.seconds, "steps": steps, "params": int(model.count_params()),
            "loss": float(history.history["loss"][-1]), "ranks": n}


def train_tf_keras_strategy(kind: str, repeat: int, global_batch: int, epochs: int, lr: float) -> dict:
    """tf_keras under MultiWorkerMirroredStrategy, from ``sparktrain.tensorflow.strategy()``."""
    import tensorflow as tf
    import tf_keras

    import sparktrain.tensorflow as hvd

    strategy = hvd.strategy()
    x, y = load_data(repeat, global_batch)
    steps = len(x) // global_batch

    def dataset_fn(ctx):  # each worker reads its own shard, like the Keras 3 ranks do
        i, k = ctx.input_pipeline_id, ctx.num_input_pipelines
        return pipeline(tf, x[i::k], y[i::k], ctx.get_per_replica_batch_size(global_batch))

    data = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = build_model(tf_keras, kind)
        model.compile(optimizer=tf_keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    timer = epoch_timer(tf_keras.callbacks.Callback)
    history = model.fit(data, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[timer])
    return {"epoch_s": timer.seconds, "steps": steps, "params": int(model.count_params()),
            "loss": float(history.history["loss"][-1]), "ranks": strategy.num_replicas_in_sync}


# -- driver side ---------------------------------------------------------------------------------

class Contender:
    def __init__(self, name: str, fn, args: tuple, num_proc: int, env: dict, cores: int | None = None):
        self.name, self.fn, self.args, self.num_proc, self.env = name, fn, args, num_proc, env
        self.cores = cores  # run confined to this many cores (None: the machine's)
        self.epochs: list[float] = []  # timed epochs, first epoch of every run dropped
        self.first: list[float] = []   # the dropped first epochs
        self.info: dict = {}
        self.status: str | None = None  # why there are no numbers

    def median(self) -> float | None:
        return statistics.median(self.epochs) if self.status is None and self.epochs else None


def build_contenders(args) -> list[Contender]:
    n, sign = args.num_proc, (1 if args.spark else -1)
    # One learning rate for all: they all take steps of the same global batch.
    common = (args.model, args.repeat_data, args.global_batch, args.epochs, 0.001 * args.global_batch / 32)
    return [
        Contender(OURS, train_keras3, (*common, True), sign * n, BASE_ENV),
        Contender(PEER, train_tf_keras_strategy, common, sign * n, {**BASE_ENV, "TF_USE_LEGACY_KERAS": "1"}),
        Contender(SINGLE, train_keras3, (*common, False), sign * 1, BASE_ENV),
    ]


SCALING_BEGIN = "<!-- epoch_scaling:begin -->"
SCALING_END = "<!-- epoch_scaling:end -->"
# One compute thread; TensorFlow's inter-op pool keeps 2, as sparktrain's thread defaults do.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
SCALING_HEADER = ["contender", "ranks x batch", "steps/epoch", "timed epochs", "median epoch s", "samples/s",
                  "x one process", "x one process on 1 core", "last loss"]


def build_scaling(args) -> list[Contender]:
    def common(global_batch):
        return (args.model, args.repeat_data, global_batch, args.epochs, 0.001 * global_batch / 32)

    sign = 1 if args.spark else -1
    one, two = common(args.global_batch), common(args.global_batch * 2)
    base = {**BASE_ENV, **ONE_THREAD, **({} if args.pin else {"SPARKTRAIN_PIN_CORES": "off"})}
    return [
        Contender("one process, 1 thread", train_keras3, (*one, False), sign * 1, base),
        # Each of the 2 ranks below has one core to itself; so has this one process.
        Contender("one process, 1 thread, 1 core", train_keras3, (*one, False), sign * 1, base, cores=1),
        Contender("2 ranks x 1 thread, native engine, same global batch", train_keras3, (*one, True), sign * 2,
                  {**base, "SPARKTRAIN_CPU_COLLECTIVES": "native"}),
        Contender("2 ranks x 1 thread, TensorFlow ring, same global batch", train_keras3, (*one, True), sign * 2,
                  {**base, "SPARKTRAIN_CPU_COLLECTIVES": "tensorflow"}),
        Contender("2 ranks x 1 thread, native engine, same batch per rank", train_keras3, (*two, True), sign * 2,
                  {**base, "SPARKTRAIN_CPU_COLLECTIVES": "native"}),
        Contender("2 ranks x 1 thread, TensorFlow ring, same batch per rank", train_keras3, (*two, True), sign * 2,
                  {**base, "SPARKTRAIN_CPU_COLLECTIVES": "tensorflow"}),
    ]


def scaling_rows(contenders: list[Contender]) -> list[list[str]]:
    def rate_of(c):
        return c.info["steps"] * c.args[2] / c.median() if c.median() else None

    one_rate, core_rate = rate_of(contenders[0]), rate_of(contenders[1])
    rows = []
    for c in contenders:
        med, global_batch = c.median(), c.args[2]
        shape = f"{abs(c.num_proc)} x {global_batch // abs(c.num_proc)}"
        if med is None:
            rows.append([c.name, shape, c.status or "no timed epochs"])
            continue
        steps = c.info["steps"]
        rate = steps * global_batch / med
        rows.append([c.name, shape, str(steps), str(len(c.epochs)), f"{med:.3f}", f"{rate:,.0f}",
                     f"{rate / one_rate:.2f}x" if one_rate else "n/a",
                     f"{rate / core_rate:.2f}x" if core_rate else "n/a", f"{c.info['loss']:.4f}"])
    return rows


@contextlib.contextmanager
def confined(cores: int | None):
    """Every thread of this process (and so every process it starts) on its first ``cores`` cores."""
    if not cores:
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    tids = [int(t) for t in os.listdir("/proc/self/task")]

    def pin(which):
        for tid in tids:
            try:
                os.sched_setaffinity(tid, which)
            except OSError:  # a thread that ended meanwhile
                pass

    pin(allowed[:cores])
    try:
        yield
    finally:
        pin(allowed)


def run_once(c: Contender, timeout: float | None) -> None:
    import sparktrain

    started = time.perf_counter()
    with confined(c.cores):
        out = sparktrain.run(c.fn, args=c.args, num_proc=c.num_proc, env=c.env, verbose=0, output_ranks=[0],
                             stdout=sys.stderr, timeout=timeout)
    wall = time.perf_counter() - started
    c.first.append(out["epoch_s"][0])
    c.epochs.extend(out["epoch_s"][1:])
    c.info = {k: v for k, v in out.items() if k != "epoch_s"}
    print(f"{c.name:<31} run {wall:6.1f} s, epochs " + " ".join(f"{s:.3f}" for s in out["epoch_s"])
          + f" s, last loss {out['loss']:.4f}", file=sys.stderr, flush=True)


def benchmark(contenders: list[Contender], rounds: int, settle_s: float, timeout: float | None) -> None:
    """``rounds`` times: every contender once, in order. A failing contender is dropped, the rest go on."""
    for _ in range(rounds):
        for c in contenders:
            if c.status is not None:
                continue
            if settle_s > 0:
                settle(settle_s)
            try:
                run_once(c, timeout)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - one contender failing must not stop the others
                c.status = f"failed: {short_reason(e)}"
                print(f"--- {c.name} failed; full error follows ---", file=sys.stderr)
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
                print(f"--- end of {c.name} error ---", file=sys.stderr, flush=True)


HEADER = ["contender", "ranks x batch", "steps/epoch", "timed epochs", "median epoch s", "min s", "max s",
          "ratio to tf_keras strategy", "samples/s", "last loss"]


def table_rows(contenders: list[Contender], global_batch: int) -> list[list[str]]:
    peer = next(c for c in contenders if c.name == PEER).median()
    rows = []
    for c in contenders:
        med = c.median()
        shape = f"{abs(c.num_proc)} x {global_batch // abs(c.num_proc)}"
        if med is None:
            rows.append([c.name, shape, c.status or "no timed epochs"])
            continue
        steps = c.info["steps"]
        rows.append([c.name, shape, str(steps), str(len(c.epochs)), f"{med:.3f}", f"{min(c.epochs):.3f}",
                     f"{max(c.epochs):.3f}", f"{med / peer:.2f}x" if peer else "n/a",
                     f"{steps * global_batch / med:,.0f}", f"{c.info['loss']:.4f}"])
    return rows


def target_line(contenders: list[Contender]) -> str:
    by = {c.name: c.median() for c in contenders}
    ours, peer = by[OURS], by[PEER]
    if ours is None or peer is None:
        return f"target ({OURS} faster than {PEER}): not measured"
    ratio = peer / ours
    return (f"target: {PEER} / {OURS} = {ratio:.2f}x (> 1 means DistributedOptimizer is faster): "
            f"{'yes' if ratio > 1 else 'NO'}")


def model_line(contenders: list[Contender], args) -> str:
    params = sorted({c.info["params"] for c in contenders if c.info})
    samples = next((c.info["steps"] * args.global_batch for c in contenders if c.info), None)
    return (f"model {args.model} ({', '.join(map(str, params)) or '?'} parameters), digits x {args.repeat_data} = "
            f"{f'{samples:,}' if samples is not None else '?'} samples per epoch, global batch {args.global_batch}, "
            f"{args.epochs} epochs per run (first dropped), {args.rounds} round(s)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=6,
                   help="epochs per run, the first of which is dropped (default 6: 5 timed)")
    p.add_argument("--repeat-data", type=int, default=10,
                   help="tile the 1500 digits training images this many times (default 10: 14,976 samples, "
                        "156 steps of 96 per epoch)")
    p.add_argument("--global-batch", type=int, default=96, help="global batch (default 96 = 3 ranks x 32)")
    p.add_argument("--num-proc", type=int, default=3, help="ranks of the two distributed contenders (default 3)")
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                   help="cnn: sparktrain.demo.build_cnn's network (default); mlp: 64-256-128-10")
    p.add_argument("--rounds", type=int, default=2,
                   help="run all contenders this many times, in turn, pooling their timed epochs (default 2)")
    p.add_argument("--spark", action="store_true",
                   help="launch through an embedded Spark session (--master) instead of local processes")
    p.add_argument("--master", default="local[3]", help="master of the embedded session with --spark (default local[3])")
    p.add_argument("--settle", type=float, default=15.0, metavar="S",
                   help="before each run, wait at most S seconds for the CPU to go quiet (default 15; 0 skips)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--scaling", action="store_true",
                   help="one process with 1 thread against 2 ranks with 1 thread each, native engine and TensorFlow ring")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="with --scaling, leave the ranks unpinned (SPARKTRAIN_PIN_CORES=off) instead of sparktrain's "
                        "default, which gives each rank cores of its own in local mode")
    p.add_argument("--write", metavar="PATH", help="write or replace the epoch-time section of this markdown file")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is dropped")
    if min(args.repeat_data, args.num_proc, args.rounds, args.global_batch) < 1:
        p.error("--repeat-data, --num-proc, --rounds and --global-batch must be at least 1")
    if args.global_batch % args.num_proc:
        p.error(f"--global-batch {args.global_batch} must be a multiple of --num-proc {args.num_proc}")
    if 1500 * args.repeat_data < args.global_batch:
        p.error("--repeat-data is too small for one global batch")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))
    # The ranks must run this interpreter, where sparktrain, TensorFlow and tf_keras are installed.
    os.environ["PYSPARK_PYTHON"] = sys.executable

    spark = None
    if args.spark:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(args.master).appName("sparktrain-epoch-time")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    contenders = build_scaling(args) if args.scaling else build_contenders(args)
    try:
        benchmark(contenders, args.rounds, args.settle, args.timeout)
    finally:
        if spark is not None:
            spark.stop()

    if args.scaling:
        return write_scaling(args, contenders, command)
    rows = table_rows(contenders, args.global_batch)
    machine, model, target = machine_line(("sparktrain", "tensorflow", "keras", "tf_keras"), args.master if args.spark else None), model_line(contenders, args), target_line(contenders)
    print()
    print(f"epoch time, {args.num_proc} ranks vs one process, "
          f"{'Spark ' + args.master if args.spark else 'local mode'}")
    print(f"machine: {machine}")
    print(model)
    print()
    print(text_table(HEADER, rows))
    print()
    print(target)
    if args.write:
        write_section(args.write, markdown_section(
            SECTION_BEGIN, SECTION_END, "Epoch time",
            "Median epoch time of the same model, data and global batch, each contender run by `sparktrain.run` "
            "in the same invocation, timed inside the ranks (rank 0's view) with the first epoch of every run "
            "dropped. Written by `benchmarks/epoch_time.py`.",
            machine, command, HEADER, rows, before_command=[model[0].upper() + model[1:] + "."],
            after_table=[target[0].upper() + target[1:]]),
                      SECTION_BEGIN, SECTION_END)
        print(f"wrote the epoch-time section of {args.write}")
    return 0 if all(c.status is None for c in contenders) else 1


def write_scaling(args, contenders: list[Contender], command: str) -> int:
    rows = scaling_rows(contenders)
    machine = machine_line(("sparktrain", "tensorflow", "keras"), args.master if args.spark else None)
    model = model_line(contenders, args) + f"; the same-batch-per-rank rows take a global batch of {2 * args.global_batch}"
    print()
    print("CPU scaling: one process with 1 thread against 2 ranks with 1 thread each")
    print(f"machine: {machine}")
    print(model)
    print()
    print(text_table(SCALING_HEADER, rows))
    if args.write:
        write_section(args.write, markdown_section(
            SCALING_BEGIN, SCALING_END, "CPU scaling: 1 process against 2 ranks, 1 thread each",
            "Samples per second of the same model and data: one process with one thread (free to use both cores "
            "for TensorFlow's inter-op and input threads, then confined to one core, as each rank is: pinned ranks "
            "get one core each), and two ranks with one thread each whose gradients are averaged by sparktrain's native engine or by TensorFlow's ring, "
            "first with the same global batch (each rank takes half), then with the same batch per rank (the "
            "global batch doubles, as in Horovod's scaling figures). Timed inside rank 0, first epoch of every "
            "run dropped. Written by `benchmarks/epoch_time.py --scaling`.",
            machine, command, SCALING_HEADER, rows, before_command=[model[0].upper() + model[1:] + "."]),
                      SCALING_BEGIN, SCALING_END)
        print(f"wrote the CPU-scaling section of {args.write}")
    return 0 if all(c.status is None for c in contenders) else 1


if __name__ == "__main__":
    sys.exit(main())
