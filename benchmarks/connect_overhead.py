#!/usr/bin/env python
"""Launch overhead over Spark Connect: ``sparktrain.run`` next to a bare barrier stage and the peers.

The same contenders as ``launch_overhead.py`` (a no-op on 3 ranks, warmed up once, then timed
``--repeats`` times in a block of its own), measured twice in one run:
- over the embedded Connect server that ``SparkSession.builder.remote("local[3]")`` starts;
- over a Connect server in its own process (``spark-submit`` of the Connect server class),
  reached at ``sc://127.0.0.1:PORT``, whose driver is not this process.

``sparktrain.run`` over Connect includes its one-task probe of whether the executors can reach
this client (see docs/connect.md). The target: at most 2.5x the bare Connect stage (each rank process starts with its run).

    python benchmarks/connect_overhead.py --repeats 5 [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine_line, text_table, write_section  # noqa: E402
from connect_server import ConnectServer  # noqa: E402 - the test suite's Connect server launcher
import launch_overhead  # noqa: E402
from launch_overhead import FLOOR, SPARKTRAIN, TF_PEER, TORCH_PEER, benchmark, build_contenders  # noqa: E402

SECTION_BEGIN = "<!-- connect_overhead:begin -->"
SECTION_END = "<!-- connect_overhead:end -->"
TARGET_RATIO = 2.5
RANKS = 3


def measure(kind: str, repeats: int, timeout: float) -> list:
    from pyspark.sql import SparkSession

    server = None
    saved = dict(os.environ)
    if kind == "embedded":
        spark = SparkSession.builder.remote(f"local[{RANKS}]").getOrCreate()
    else:
        server = ConnectServer(f"local[{RANKS}]")
        spark = SparkSession.builder.remote(server.url).getOrCreate()
    try:
        contenders = build_contenders(spark, RANKS)
        benchmark(spark, contenders, repeats, timeout)
        return contenders
    finally:
        spark.stop()
        if server is not None:
            server.stop()
        os.environ.clear()
        os.environ.update(saved)  # the embedded server leaves its token, which would turn on TLS next


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--write", metavar="RESULTS.md")
    args = parser.parse_args()
    # A terminated benchmark still stops the Connect server it started (its own process group).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    # The no-op and the floor's task travel by value, whichever cloudpickle pickles them (sparktrain
    # uses cloudpickle, Spark's UDFs and TorchDistributor pyspark's copy): a separate server's
    # executors cannot import this folder.
    cloudpickle.register_pickle_by_value(launch_overhead)
    spark_cloudpickle.register_pickle_by_value(launch_overhead)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger().setLevel(logging.WARNING)

    header = ["server", "contender", "median s", "min s", "max s", "ratio to bare Connect stage"]
    rows, targets = [], []
    for kind, label in (("embedded", "embedded remote(local[3])"), ("server", "separate server process")):
        contenders = measure(kind, args.repeats, args.timeout)
        by_name = {c.name: c for c in contenders}
        floor = by_name[FLOOR].median()
        for c in contenders:
            med = c.median()
            if med is None:
                rows.append([label, c.name, c.status or "no timed runs"])
                continue
            rows.append([label, c.name, f"{med:.3f}", f"{min(c.times):.3f}", f"{max(c.times):.3f}",
                         f"{med / floor:.2f}x" if floor else "n/a"])
        ours = by_name[SPARKTRAIN].median()
        if ours is not None and floor:
            ratio = ours / floor
            targets.append(f"{label}: sparktrain/bare = {ratio:.2f}x <= {TARGET_RATIO}x: "
                           f"{'yes' if ratio <= TARGET_RATIO else 'NO'}")
    machine = machine_line(["torch", "spark-tensorflow-distributor"], f"Spark Connect, local[{RANKS}]")
    target_line = "targets: " + "; ".join(targets)
    print(machine)
    print(text_table(header, rows))
    print(target_line)
    if args.write:
        intro = (f"Wall time of a no-op on {RANKS} ranks over Spark Connect, one warm session per server, each "
                 f"contender warmed up once and then timed {args.repeats} times in a block of its own; the bare "
                 f"stage in two blocks, before and after sparktrain's. Each of `{SPARKTRAIN}`'s rank "
                 f"processes starts with its run, held while the ranks meet. "
                 f"{TF_PEER} is listed to show that it does not run over Connect; {TORCH_PEER} does.")
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Launch overhead over Spark Connect", intro, machine,
            f"python benchmarks/connect_overhead.py --repeats {args.repeats} --write benchmarks/RESULTS.md", header,
            rows, after_table=[target_line])
    return 0


if __name__ == "__main__":
    sys.exit(main())
