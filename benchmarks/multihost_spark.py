#!/usr/bin/env python
"""The 64 MiB allreduce in ranks that Spark started, on simulated hosts, against the link.

A Spark standalone cluster on simulated hosts (``tests/standalone.py``: one core per host, which
runs the host's worker, executor, Python workers and ranks alike), ``--per-host`` ranks per host,
and one ``sparktrain.run`` per encryption setting (``encryption="off"`` and ``"on"``). In each
run every rank times, on the same hosts and links, the 64 MiB sum allreduce:

- through the TensorFlow kernels (``sparktrain.tensorflow.allreduce`` of a float32 tensor, the
  result read back with ``.numpy()``), as a training step does;
- on the native engine directly (the same communicator, numpy in place), which shows what the
  TensorFlow path adds;

shaped to ``--shape`` (a tbf qdisc on both ends of every host's link; ``none`` leaves them alone)
while the cluster stays up. Algorithm bandwidth is 64 MiB over the median time; a ring's most is
link x h / (2(h-1)), with the shaped rate as the link. Needs root.

    sudo .venv/bin/python benchmarks/multihost_spark.py [--hosts 2] [--per-host 1] \\
        [--shape 1gbit,none] [--iters 7] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import sys

import common
from common import machine_line, median_seconds, text_table, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

LARGE = 64 << 20
RATES = {"1gbit": 125e6, "100mbit": 12.5e6}
BEGIN, END = "<!-- multihost-spark:begin -->", "<!-- multihost-spark:end -->"
HEADER = ["hosts", "ranks/host", "link", "encryption", "engine MB/s", "TF kernels MB/s", "engine / limit",
          "TF / limit", "TF / engine"]


def time_allreduces(iters: int, nbytes: int) -> dict:
    """In a rank: the median seconds of a sum allreduce of ``nbytes`` through the TensorFlow
    kernels and on the engine directly, after one warm-up of each."""
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.tensorflow.runtime import state

    hvd.init()
    x = tf.zeros([nbytes // 4], tf.float32)
    a = np.zeros(nbytes // 4, np.float32)

    def through_tf():
        hvd.allreduce(x, op=hvd.Sum).numpy()

    def on_engine():
        state.comm.allreduce_(a, "sum")

    out = {"kernels": hvd.collective_kernels(), "encrypted": bool(getattr(state.comm, "encrypted", False))}
    for name, call in (("engine", on_engine), ("tf", through_tf)):
        out[name] = median_seconds(call, iters)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=1)
    p.add_argument("--shape", default="1gbit,none")
    p.add_argument("--encryption", default="off,on")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--write", metavar="RESULTS_MD")
    args = p.parse_args()

    import cloudpickle

    import simhosts
    from standalone import cluster_session

    import sparktrain

    reason = simhosts.why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    for module in (sys.modules[__name__], common):  # the executors need not find benchmarks/
        cloudpickle.register_pickle_by_value(module)
    h, per = args.hosts, args.per_host
    ring = h / (2 * (h - 1))
    rows = []
    with cluster_session(h, per) as (sim, _standalone, _session):
        for shape in args.shape.split(","):
            sim.shape_all(shape)
            for encryption in args.encryption.split(","):
                got = sparktrain.run(time_allreduces, args=(args.iters, LARGE), num_proc=h * per, verbose=0,
                                     encryption=encryption, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
                engine, tf = LARGE / got["engine"] / 1e6, LARGE / got["tf"] / 1e6
                limit = RATES[shape] / 1e6 * ring if shape in RATES else None
                rows.append([str(h), str(per), shape, encryption, f"{engine:.0f}", f"{tf:.0f}",
                             f"{engine / limit:.2f}" if limit else "-", f"{tf / limit:.2f}" if limit else "-",
                             f"{tf / engine:.2f}"])
                print(text_table(HEADER, rows[-1:]), f"kernels={got['kernels']}", flush=True)
    print()
    print(text_table(HEADER, rows))
    if args.write:
        write_section(
            args.write, BEGIN, END, "Allreduce in ranks that Spark started, across simulated hosts",
            "A Spark standalone cluster on simulated hosts of one core each (the host's worker, executor, Python "
            "workers and ranks share it), one sparktrain.run per encryption setting; in each, every rank times the "
            "64 MiB sum allreduce through the TensorFlow kernels (`.numpy()` of the result included) and on the "
            "native engine directly, on the same hosts. Algorithm bandwidth is 64 MiB over the median time; the "
            "limit is the shaped link x h / (2(h-1)). Written by `benchmarks/multihost_spark.py`.",
            machine_line(["tensorflow"], master="spark standalone on simulated hosts"),
            " ".join(["python", "benchmarks/multihost_spark.py", *sys.argv[1:]]), HEADER, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
