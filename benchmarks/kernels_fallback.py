#!/usr/bin/env python
"""What a host without a C++ compiler costs: the native engine's TensorFlow kernels against their
fallback, ``tf.numpy_function``.

Where a rank cannot compile the kernels (no compiler, no TensorFlow headers) or is told not to
(``SPARKTRAIN_TF_KERNELS=0``), every collective of ``sparktrain.tensorflow`` inside a
``tf.function`` calls back into Python through ``tf.numpy_function`` and then the same engine.
Both contenders run in one invocation, alternating, as ``sparktrain.run`` in local mode (no
Spark); the fallback is asked for with ``SPARKTRAIN_TF_KERNELS=0`` (the path a compiler-less host
takes, without its warning), and each rank checks which path it is on:

- an allreduce (sum, float32) of 4 KiB and of 16 MiB inside a ``tf.function``, 2 ranks: the
  median over ``--rounds`` runs of each run's median call time (calls timed in batches);
- the epoch time of ``benchmarks/epoch_time.py``'s Keras 3 contender (``DistributedOptimizer``,
  the digits CNN), 2 ranks, first epoch of each run dropped.

The table gives the fallback's time over the kernels'.

    python benchmarks/kernels_fallback.py [--rounds 3] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

from common import machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- kernels_fallback:begin -->"
SECTION_END = "<!-- kernels_fallback:end -->"
HERE = os.path.dirname(os.path.abspath(__file__))
#: The contenders: the rank environment each runs under.
CONTENDERS = {"kernels": {"TF_CPP_MIN_LOG_LEVEL": "3"},
              "tf.numpy_function": {"TF_CPP_MIN_LOG_LEVEL": "3", "SPARKTRAIN_TF_KERNELS": "0"}}
SIZES = {"4 KiB": 1024, "16 MiB": 4 << 20}  # float32 elements


def allreduce_times(sizes: dict, seconds: float) -> dict:
    """In each rank: the median time of one allreduce of each size inside a tf.function."""
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    found = {"kernels": hvd.collective_kernels()}
    for label, n in sizes.items():
        x = tf.ones([n], tf.float32)
        step = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum))
        for _ in range(5):
            step()
        # Calls in batches of ``k`` (at least ~20 ms a batch), until ``seconds`` have gone; rank 0 decides.
        started = time.perf_counter()
        step().numpy()
        k = max(1, int(0.02 / max(time.perf_counter() - started, 1e-6)))
        k = int(hvd.broadcast(tf.constant(k), root_rank=0).numpy())
        batches = []
        deadline = time.perf_counter() + seconds
        while True:
            started = time.perf_counter()
            for _ in range(k):
                y = step()
            y.numpy()
            batches.append((time.perf_counter() - started) / k)
            done = float(len(batches) >= 5 and time.perf_counter() > deadline)
            if hvd.broadcast(tf.constant(done), root_rank=0).numpy():
                break
        assert float(y.numpy()[0]) == hvd.size()
        found[label] = statistics.median(batches)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed per size and run (default 3)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeat-data", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.path.insert(0, HERE)
    import cloudpickle

    import epoch_time
    import kernels_fallback

    cloudpickle.register_pickle_by_value(epoch_time)  # the ranks cannot import the benchmarks' modules
    cloudpickle.register_pickle_by_value(kernels_fallback)
    import sparktrain

    n = args.num_proc
    train = (epoch_time.train_keras3, ("cnn", args.repeat_data, args.global_batch, args.epochs,
                                        0.001 * args.global_batch / 32, True))
    times: dict[str, dict[str, list[float]]] = {c: {**{k: [] for k in SIZES}, "epoch": []} for c in CONTENDERS}
    for r in range(args.rounds):
        for name, env in CONTENDERS.items():
            settle()
            got = sparktrain.run(kernels_fallback.allreduce_times, args=(SIZES, args.seconds), num_proc=-n, env=env,
                                 verbose=0)
            if got["kernels"] != (name == "kernels"):
                raise SystemExit(f"the {name} contender ran with collective_kernels() = {got['kernels']}")
            for k in SIZES:
                times[name][k].append(got[k])
            settle()
            out = sparktrain.run(train[0], args=train[1], num_proc=-n, env=env, verbose=0)
            times[name]["epoch"].append(statistics.median(out["epoch_s"][1:]))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[-1] * 1e3:.3f} ms" for k, v in times[name].items()),
                  file=sys.stderr, flush=True)
    header = ["what (2 ranks)", "kernels", "tf.numpy_function", "ratio (fallback / kernels)"]
    rows = []
    for k, n_elems in SIZES.items():
        a, b = (statistics.median(times[c][k]) for c in CONTENDERS)
        rows.append([f"allreduce {k} in tf.function, per call", f"{a * 1e6:.0f} us", f"{b * 1e6:.0f} us",
                     f"{b / a:.2f}x"])
    a, b = (statistics.median(times[c]["epoch"]) for c in CONTENDERS)
    rows.append([f"epoch_time.py Keras 3 CNN, epoch ({args.global_batch} global batch)", f"{a:.3f} s", f"{b:.3f} s",
                 f"{b / a:.2f}x"])
    print(text_table(header, rows))
    if args.write:
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Without a compiler: the TensorFlow kernels' fallback",
                      f"The native engine's collectives inside a `tf.function` through sparktrain's TensorFlow kernels "
                      f"and through their fallback, `tf.numpy_function` (SPARKTRAIN_TF_KERNELS=0, the path of a host "
                      f"without a C++ compiler), {n} ranks in local mode, alternating over {args.rounds} rounds; "
                      "medians of each run's median. Written by `benchmarks/kernels_fallback.py`.",
                      machine_line(["sparktrain", "tensorflow", "keras"]),
                      " ".join(shlex.quote(a) for a in [sys.executable, "benchmarks/kernels_fallback.py",
                                                         *sys.argv[1:]]),
                      header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
