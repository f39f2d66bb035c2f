#!/usr/bin/env python
"""Synthetic images/second of a small ResNet-like Keras 3 model on 1, 2 and 3 ranks, per CPU engine.

Horovod's synthetic benchmark, on sparktrain: every rank trains the same model on one batch of
random images (drawn once, so no input pipeline is timed) with ``DistributedGradientTape`` and a
Keras SGD, in a ``tf.function`` step; after ``--num-warmup-batches`` untimed steps, ``--num-iters``
iterations of ``--num-batches-per-iter`` steps are timed. Each rank's images/s is the mean over
the iterations; the total is the sum over the ranks (gathered with ``allgather``), and the
scaling ratio is the total over the one-rank total. Every contender is one ``sparktrain.run``
in local mode, run one after the other in this invocation:

- 1 rank (no collective runs);
- 2 and 3 ranks, the gradients averaged by sparktrain's native engine
  (``SPARKTRAIN_CPU_COLLECTIVES=native``);
- 2 and 3 ranks, averaged by TensorFlow's gRPC ring (``SPARKTRAIN_CPU_COLLECTIVES=tensorflow``).

Each rank uses sparktrain's default threads (the host's cores shared among its ranks) unless
``--threads`` sets them. Take numbers on a quiet machine::

    python benchmarks/synthetic.py [--image-size 32 --batch-size 32] [--write benchmarks/RESULTS.md]

A smoke run that takes seconds::

    python benchmarks/synthetic.py --image-size 16 --batch-size 4 --num-iters 2 --num-batches-per-iter 2 --ranks 1,2
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

from common import failed, machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- synthetic:begin -->"
SECTION_END = "<!-- synthetic:end -->"
BASE_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
ENGINES = {"native": "native engine", "tensorflow": "TensorFlow ring"}


# -- what the ranks run (self-contained: cloudpickle ships these functions by value) -------------

def resnet_like(keras, image_size: int, width: int, classes: int):
    """A stem, three stages of one residual block each (the last two halve the resolution), pooling, a classifier."""
    def block(x, filters, stride):
        shortcut = x
        y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
            shortcut = keras.layers.BatchNormalization()(shortcut)
        return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))

    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for i, stride in enumerate((1, 2, 2)):
        x = block(x, width * 2 ** i, stride)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(x))


def synthetic_rank(image_size: int, batch_size: int, width: int, warmup: int, per_iter: int, iters: int) -> dict:
    """Horovod's synthetic benchmark loop on one rank; returns every rank's images/s (rank 0's view)."""
    import timeit

    import keras
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    model = resnet_like(keras, image_size, width, 1000)
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)
    data = tf.random.uniform([batch_size, image_size, image_size, 3])
    target = tf.random.uniform([batch_size, 1], minval=0, maxval=999, dtype=tf.int64)

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, model(data, training=True)))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    step(True)
    timeit.timeit(lambda: step(False), number=warmup)
    img_secs = [batch_size * per_iter / timeit.timeit(lambda: step(False), number=per_iter) for _ in range(iters)]
    mine = float(np.mean(img_secs))
    everyone = hvd.allgather(tf.constant([mine], tf.float64)).numpy().tolist() if hvd.size() > 1 else [mine]
    return {"per_rank": everyone, "params": int(model.count_params()), "engine": hvd.collective_engine()
            if hvd.size() > 1 else "none"}


# -- driver side ---------------------------------------------------------------------------------

class Contender:
    def __init__(self, name: str, ranks: int, env: dict):
        self.name, self.ranks, self.env = name, ranks, env
        self.out: dict | None = None
        self.status: str | None = None

    def total(self) -> float | None:
        return sum(self.out["per_rank"]) if self.out else None


def build_contenders(args) -> list[Contender]:
    threads = {}
    if args.threads:
        threads = {"OMP_NUM_THREADS": str(args.threads), "TF_NUM_INTRAOP_THREADS": str(args.threads),
                   "TF_NUM_INTEROP_THREADS": "2"}
    out = []
    if 1 in args.ranks:
        out.append(Contender("1 rank", 1, {**BASE_ENV, **threads}))
    for engine, label in ENGINES.items():
        for n in args.ranks:
            if n > 1:
                out.append(Contender(f"{n} ranks, {label}", n,
                                     {**BASE_ENV, **threads, "SPARKTRAIN_CPU_COLLECTIVES": engine}))
    return out


def run_all(contenders: list[Contender], args) -> None:
    import sparktrain

    for c in contenders:
        if args.settle > 0:
            settle(args.settle)
        started = time.perf_counter()
        try:
            c.out = sparktrain.run(synthetic_rank, args=(args.image_size, args.batch_size, args.width,
                                                         args.num_warmup_batches, args.num_batches_per_iter,
                                                         args.num_iters),
                                   num_proc=-c.ranks, env=c.env, verbose=0, output_ranks=[0], stdout=sys.stderr,
                                   timeout=args.timeout)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - one contender failing must not stop the others
            c.status = failed(c.name, e)
            continue
        print(f"{c.name:<28} run {time.perf_counter() - started:6.1f} s, img/s per rank "
              + " ".join(f"{v:.1f}" for v in c.out["per_rank"]), file=sys.stderr, flush=True)


HEADER = ["contender", "ranks", "img/s per rank (mean)", "img/s per rank (min-max)", "total img/s",
          "x one rank", "scaling efficiency"]


def table_rows(contenders: list[Contender]) -> list[list[str]]:
    one = next((c.total() for c in contenders if c.ranks == 1), None)
    rows = []
    for c in contenders:
        if c.out is None:
            rows.append([c.name, str(c.ranks), c.status or "not run"])
            continue
        per, total = c.out["per_rank"], c.total()
        ratio = total / one if one else None
        rows.append([c.name, str(c.ranks), f"{statistics.mean(per):.1f}", f"{min(per):.1f}-{max(per):.1f}",
                     f"{total:.1f}", f"{ratio:.2f}x" if ratio else "n/a",
                     f"{ratio / c.ranks:.0%}" if ratio else "n/a"])
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=32, help="square images of this side (default 32)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step (default 32)")
    p.add_argument("--width", type=int, default=16, help="filters of the first stage; doubled per stage (default 16)")
    p.add_argument("--num-warmup-batches", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration (default 10)")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations (default 5)")
    p.add_argument("--ranks", default="1,2,3", help="rank counts to run, separated by commas (default 1,2,3)")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per rank (default 0: sparktrain's, the host's cores shared among ranks)")
    p.add_argument("--settle", type=float, default=15.0, metavar="S",
                   help="before each run, wait at most S seconds for the CPU to go quiet (default 15; 0 skips)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--write", metavar="PATH", help="write or replace the synthetic section of this markdown file")
    args = p.parse_args(argv)
    try:
        args.ranks = sorted({int(r) for r in args.ranks.split(",")})
    except ValueError:
        p.error(f"--ranks must be numbers separated by commas such as 1,2,3, got {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1:
        p.error(f"--ranks must be positive, got {args.ranks}")
    if min(args.image_size, args.batch_size, args.width, args.num_batches_per_iter, args.num_iters) < 1 \
            or args.num_warmup_batches < 0 or args.threads < 0:
        p.error("sizes, batches and iterations must be at least 1 (warm-up and threads at least 0)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))
    os.environ["PYSPARK_PYTHON"] = sys.executable
    contenders = build_contenders(args)
    run_all(contenders, args)
    rows = table_rows(contenders)
    machine = machine_line(("sparktrain", "tensorflow", "keras"))
    params = next((c.out["params"] for c in contenders if c.out), None)
    setup = (f"ResNet-like model ({params if params is not None else '?'} parameters), {args.image_size}x"
             f"{args.image_size} random images, batch {args.batch_size} per rank, {args.num_warmup_batches} warm-up "
             f"steps, {args.num_iters} x {args.num_batches_per_iter} timed steps, threads per rank: "
             f"{args.threads or 'sparktrain default'}")
    print()
    print("synthetic images/s, local mode")
    print(f"machine: {machine}")
    print(setup)
    print()
    print(text_table(HEADER, rows))
    if args.write:
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Synthetic images/s: 1, 2 and 3 ranks per CPU engine",
            "Horovod's synthetic benchmark on sparktrain: a small ResNet-like Keras 3 model trained on random images "
            "with `DistributedGradientTape`, images/s per rank and in total, with sparktrain's native engine and "
            "with TensorFlow's ring; the ratio is the total over one rank's. Written by `benchmarks/synthetic.py`.",
            machine, command, HEADER, rows, before_command=[setup + "."])
    return 0 if all(c.status is None for c in contenders) else 1


if __name__ == "__main__":
    sys.exit(main())
