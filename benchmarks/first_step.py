#!/usr/bin/env python
"""Time to the first training step: a Keras job under ``sparktrain.run`` against the same job in
one process.

The job imports Keras (TensorFlow backend), builds a small CNN for 8x8 digits, compiles it and
trains one batch (``train_on_batch``); it writes the wall-clock time at which that first step
ended. The contenders, timed from the moment the driver starts them:

- one process: ``python -c`` running the job with a plain optimizer, as a user would on one machine;
- the same under the gc thresholds a rank sets before it loads train_fn (the ``gc_threshold``
  setting), so that what the launch itself costs shows apart from what the thresholds save;
- ``sparktrain.run(job, num_proc=N)`` on a warm ``local[N]`` SparkSession, each rank with
  ``DistributedOptimizer`` and the broadcast of rank 0's weights, as in the seed notebooks; the
  time is the last rank's first step (the first step is a collective, so they end together).

With ``N`` at most the machine's cores, the ranks import in parallel; the ratio is what a user
feels of the launch on top of the job's own start. The two alternate, so that a busy moment is
charged to both; ratios are medians of paired ratios.

    python benchmarks/first_step.py --repeats 5 [--num-proc 2] [--write benchmarks/RESULTS.md]

``--kernel-cache`` times instead the first run on a fresh job cluster: ``sparktrain.run`` with an
empty kernel cache (``SPARKTRAIN_CACHE_DIR`` a new directory: the ranks' ``init()`` compiles the
TensorFlow kernels, once for the host) against the same with the cache warm, alternating.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from common import machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- first_step:begin -->"
SECTION_END = "<!-- first_step:end -->"
TARGET_RATIO = 1.1
HERE = os.path.dirname(os.path.abspath(__file__))


def job(outdir: str, distributed: bool) -> int:
    """Import, build, compile, one batch; record when the first step ended."""
    import numpy as np

    if distributed:
        import sparktrain.keras as hvd

        hvd.init()
        rank = hvd.rank()
    else:
        rank = 0
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
    optimizer = keras.optimizers.Adam(0.01)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(rank)
    x, y = rng.random((32, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 32)
    if distributed:
        model.build((None, 8, 8, 1))
        hvd.broadcast_variables(model.variables, root_rank=0)
    model.train_on_batch(x, y)
    ended = time.time()
    with open(os.path.join(outdir, f"rank{rank}"), "w") as f:
        f.write(repr(ended))
    return 0


def one_process(outdir: str, gc_threshold: str | None = None) -> float:
    """The job in a fresh ``python``; with ``gc_threshold``, under the thresholds a rank sets first."""
    started = time.time()
    code = f"import sys; sys.path.insert(0, {HERE!r}); import first_step; first_step.job({outdir!r}, False)"
    if gc_threshold:
        code = f"import gc; gc.set_threshold({gc_threshold}); {code}"
    subprocess.run([sys.executable, "-c", code], check=True, stderr=subprocess.DEVNULL)
    return _first_step(outdir) - started


def under_run(outdir: str, n: int, env: dict | None = None) -> float:
    import sparktrain

    started = time.time()
    sparktrain.run(job, args=(outdir, True), num_proc=n, verbose=0, env=env)
    return _first_step(outdir) - started


def _first_step(outdir: str) -> float:
    ends = [float(open(p).read()) for p in glob.glob(os.path.join(outdir, "rank*"))]
    if not ends:
        raise RuntimeError(f"no rank wrote its first step's time under {outdir}")
    return max(ends)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--write", metavar="RESULTS.md")
    parser.add_argument("--kernel-cache", action="store_true", help="an empty kernel cache against a warm one")
    args = parser.parse_args(argv)
    n = args.num_proc
    master = f"local[{n}]"
    sys.path.insert(0, HERE)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python is this one
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(master).config("spark.ui.enabled", "false") \
        .config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    import cloudpickle

    import first_step

    cloudpickle.register_pickle_by_value(first_step)  # the ranks cannot import this script's module
    from sparktrain import settings

    if args.kernel_cache:
        return kernel_cache(args, spark, master)
    threshold = settings.resolve("gc_threshold")  # what every rank sets before it loads train_fn
    same_gc = f"one process, gc.set_threshold({threshold})"
    under = f"sparktrain.run, {n} ranks"
    runs: dict[str, list[float]] = {"one process": [], same_gc: [], under: []}
    with tempfile.TemporaryDirectory() as tmp:
        def fresh(tag: str) -> str:
            return tempfile.mkdtemp(dir=tmp, prefix=tag)

        first_step.under_run(fresh("warm"), n)  # the session's first stage, and the first run, untimed
        for i in range(args.repeats):
            settle()
            runs["one process"].append(first_step.one_process(fresh("one")))
            if threshold != "python":
                settle()
                runs[same_gc].append(first_step.one_process(fresh("gc"), threshold))
            settle()
            runs[under].append(first_step.under_run(fresh("run"), n))
            print(f"repeat {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items() if v), flush=True)
    spark.stop()
    runs = {k: v for k, v in runs.items() if v}
    ratios = {k: [r / o for o, r in zip(runs["one process"], v)] for k, v in runs.items()}
    header = ["contender", "median s", "min s", "max s", "ratio to one process"]
    rows = [[name, f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}",
             f"{statistics.median(ratios[name]):.2f}x"] for name, v in runs.items()]
    ratio = statistics.median(ratios[under])
    verdict = (f"Target: time to the first step under run <= {TARGET_RATIO}x one process: "
               f"{'yes' if ratio <= TARGET_RATIO else 'no'} (median of paired ratios {ratio:.2f}x)")
    if same_gc in runs:
        launch = statistics.median(r / o for o, r in zip(runs[same_gc], runs[under]))
        verdict += f"; against one process under the ranks' gc threshold: {launch:.2f}x"
    report(args, (SECTION_BEGIN, SECTION_END, "Time to the first training step"),
           "Wall time from starting a Keras job (import, build a small CNN, compile, one batch) to the "
           "end of its first step: in one process (with Python's gc thresholds, and with those a rank "
           f"sets, the gc_threshold setting), and under sparktrain.run with {n} ranks (each with "
           "DistributedOptimizer and rank 0's weights broadcast) on a warm SparkSession. They "
           "alternate; ratios are medians of paired ratios. Written by `benchmarks/first_step.py`.",
           master, header, rows, verdict)
    return 0


def report(args, section: tuple, intro: str, master: str, header: list, rows: list, verdict: str) -> None:
    """Print the table and the verdict; with ``--write``, put them in ``section`` (begin, end, title)."""
    print(text_table(header, rows))
    print(verdict)
    if args.write:
        write_section(args.write, *section, intro, machine_line(["sparktrain", "tensorflow", "keras"], master),
                      " ".join(shlex.quote(a) for a in [sys.executable, "benchmarks/first_step.py", *sys.argv[1:]]),
                      header, rows, after_table=[verdict])


CACHE_BEGIN = "<!-- first_step_cache:begin -->"
CACHE_END = "<!-- first_step_cache:end -->"


def kernel_cache(args, spark, master: str) -> int:
    """``--kernel-cache``: the first step under run with an empty kernel cache and with a warm one."""
    import first_step

    n = args.num_proc
    cold, warm = "empty kernel cache (compiles)", "warm kernel cache"
    runs: dict[str, list[float]] = {cold: [], warm: []}
    with tempfile.TemporaryDirectory() as tmp:
        warm_env = {"SPARKTRAIN_CACHE_DIR": os.path.join(tmp, "warm-cache")}
        first_step.under_run(tempfile.mkdtemp(dir=tmp), n, warm_env)  # fills the warm cache, untimed
        for i in range(args.repeats):
            settle()
            cache = tempfile.mkdtemp(dir=tmp, prefix="cold-cache")
            runs[cold].append(first_step.under_run(tempfile.mkdtemp(dir=tmp), n, {"SPARKTRAIN_CACHE_DIR": cache}))
            compiled = glob.glob(os.path.join(cache, "tf_kernels", "tf_kernels-*.so"))
            if len(compiled) != 1:
                raise RuntimeError(f"the empty cache {cache} holds {compiled} after the run, not one library")
            settle()
            runs[warm].append(first_step.under_run(tempfile.mkdtemp(dir=tmp), n, warm_env))
            print(f"repeat {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    spark.stop()
    ratios = [c / w for c, w in zip(runs[cold], runs[warm])]
    header = ["sparktrain.run, first step", "median s", "min s", "max s", "ratio to warm"]
    rows = [[name, f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}",
             f"{statistics.median(ratios) if name == cold else 1.0:.2f}x"] for name, v in runs.items()]
    extra = statistics.median(c - w for c, w in zip(runs[cold], runs[warm]))
    verdict = (f"A fresh job cluster's first run waits {extra:.1f} s longer for its first step (median of paired "
               "differences): the one compile of the host; a cache prebuilt with `sparktrain check --build` "
               "is the warm case.")
    report(args, (CACHE_BEGIN, CACHE_END, "Time to the first step: empty kernel cache against warm"),
           f"Wall time from calling sparktrain.run ({n} ranks, warm SparkSession) to the end of the first "
           "training step of the Keras job of \"Time to the first training step\", with SPARKTRAIN_CACHE_DIR a new "
           "empty directory (every rank's init() finds no TensorFlow kernels: one compiles them, the others "
           "wait on the lock and load them) and with a warm cache, alternating; the ratio is the median "
           "of paired ratios. Written by `benchmarks/first_step.py --kernel-cache`.",
           master, header, rows, verdict)
    return 0

if __name__ == "__main__":
    sys.exit(main())
