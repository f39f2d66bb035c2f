#!/usr/bin/env python
"""Launch overhead of ``sparktrain.run`` next to a bare barrier stage and peer launchers.

Every contender runs a no-op on ``--num-proc`` ranks (default 3) as one barrier stage of one
warm SparkSession that this script creates:

- ``sparktrain.run(noop, num_proc=3, verbose=0)``: each rank process starts with its run, held
  while the ranks meet (docs/process-tree.md);
- the floor: a bare barrier stage of 3 no-op tasks, ``spark.range(0, 3, 1, 3).mapInArrow(f, schema,
  barrier=True).collect()``, the same kind of stage sparktrain launches;
- ``MirroredStrategyRunner(num_slots=3, use_gpu=False).run(noop)`` from spark-tensorflow-distributor;
- ``TorchDistributor(num_processes=3, local_mode=False, use_gpu=False).run(noop)`` from pyspark.

Each contender is warmed up once (not timed), then timed ``--repeats`` times, in a block of its
own, after the machine has settled (see ``benchmark`` for why not round-robin).
A peer that is not installed is reported as skipped; one that raises is reported as
failed with a short reason (its full traceback goes to stderr) and the others carry on.

    python benchmarks/launch_overhead.py --repeats 8 --master 'local[3]' [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import statistics
import sys
import threading
import time
from typing import Any, Callable

from common import failed, machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- launch_overhead:begin -->"
SECTION_END = "<!-- launch_overhead:end -->"
TARGET_MEDIAN_S = 0.5
TARGET_SPEEDUP_VS_TF = 3.0

NOT_INSTALLED = "skipped (not installed)"
SPARKTRAIN = "sparktrain.run"
FLOOR = "bare barrier stage (floor)"
TF_PEER = "MirroredStrategyRunner"
TORCH_PEER = "TorchDistributor"


def noop():
    """What every rank runs. MirroredStrategyRunner runs it inside its strategy's scope."""
    return 0


def floor_task(batches):
    """The floor's barrier task: consume the one-row input, yield one tiny batch."""
    import pyarrow as pa

    for _ in batches:
        pass
    yield pa.RecordBatch.from_arrays([pa.array([0], pa.int32())], names=["x"])


class Contender:
    def __init__(self, name: str, call: Callable[[], Any] | None = None, status: str | None = None):
        self.name = name
        self.call = call
        self.status = status  # None while it runs; otherwise why it has no numbers
        self.times: list[float] = []
        self.warmup_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status is None

    def median(self) -> float | None:
        return statistics.median(self.times) if self.ok and self.times else None


def _installed(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):
        return False


def build_contenders(spark, n: int) -> list[Contender]:
    import sparktrain

    def floor():
        rows = spark.range(0, n, 1, n).mapInArrow(floor_task, "x int", barrier=True).collect()
        return rows[0]["x"]

    contenders = [
        Contender(SPARKTRAIN, lambda: sparktrain.run(noop, num_proc=n, verbose=0)),
        Contender(FLOOR, floor),
    ]

    # tensorflow is only checked for here, not imported: the driver never needs it, the ranks do.
    try:
        from spark_tensorflow_distributor import MirroredStrategyRunner
    except ImportError:
        contenders.append(Contender(TF_PEER, status=NOT_INSTALLED))
    else:
        if _installed("tensorflow"):
            contenders.append(Contender(
                TF_PEER, lambda: MirroredStrategyRunner(num_slots=n, use_gpu=False).run(noop)))
        else:
            contenders.append(Contender(TF_PEER, status=NOT_INSTALLED))

    try:
        from pyspark.ml.torch.distributor import TorchDistributor
    except ImportError:
        contenders.append(Contender(TORCH_PEER, status=NOT_INSTALLED))
    else:
        if _installed("torch"):
            contenders.append(Contender(
                TORCH_PEER, lambda: TorchDistributor(num_processes=n, local_mode=False, use_gpu=False).run(noop)))
        else:
            contenders.append(Contender(TORCH_PEER, status=NOT_INSTALLED))
    return contenders


def timed_call(spark, c: Contender, timeout: float) -> float:
    """Run ``c.call`` once and return its wall time; raise what it raised, or TimeoutError."""
    box: dict[str, Any] = {}

    def target():
        start = time.perf_counter()
        try:
            box["result"] = c.call()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = e
        box["elapsed"] = time.perf_counter() - start

    thread = threading.Thread(target=target, name=f"bench-{c.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if type(spark).__module__.startswith("pyspark.sql.connect"):
            spark.interruptAll()  # a Connect client has no SparkContext
        else:
            spark.sparkContext.cancelAllJobs()
        thread.join(60)
        raise TimeoutError(f"no result after {timeout:g} s (jobs cancelled)")
    if "error" in box:
        raise box["error"]
    if box.get("result") != 0:
        raise RuntimeError(f"expected 0 back from rank 0, got {box.get('result')!r}")
    return box["elapsed"]


def attempt(spark, c: Contender, timeout: float, when: str) -> float | None:
    settle()
    try:
        return timed_call(spark, c, timeout)
    except BaseException as e:  # noqa: BLE001 - a failing peer must not stop the benchmark
        if isinstance(e, KeyboardInterrupt):
            raise
        c.status = failed(c.name, e, when)
        return None


def benchmark(spark, contenders: list[Contender], repeats: int, timeout: float) -> None:
    """Each contender in its own block: one untimed warm-up, then ``repeats`` timed runs.

    Blocks, not round-robin: interleaved with TorchDistributor, every other contender slowed
    down for seconds after each of its runs (the floor went from 0.15 s to 0.41 s median here),
    which would charge its teardown to the others. The floor goes first because it starts
    Spark's Python workers, which every contender uses.
    """
    floor = next(c for c in contenders if c.name == FLOOR)
    ours = [c for c in contenders if c.name == SPARKTRAIN]
    peers = [c for c in contenders if c is not floor and c not in ours]
    # The floor is timed again after sparktrain's blocks (before the peers, whose teardown slows
    # what follows): Spark's JVM keeps getting faster as it warms up, which would favour whoever
    # goes later; the floor's median is over both blocks.
    for c in [floor, *ours, floor, *peers]:
        if not c.ok:
            continue
        if c.warmup_s is None:
            elapsed = attempt(spark, c, timeout, "warm-up")
            if elapsed is None:
                continue
            c.warmup_s = elapsed
            print(f"warm-up  {c.name:<28} {elapsed:8.3f} s", file=sys.stderr, flush=True)
        for r in range(repeats):
            elapsed = attempt(spark, c, timeout, f"timed repeat {r + 1}")
            if elapsed is None:
                break
            c.times.append(elapsed)
        print(f"timed    {c.name:<28} {' '.join(f'{t:.3f}' for t in c.times)}", file=sys.stderr, flush=True)


# -- reporting -----------------------------------------------------------------------------------

def table_rows(contenders: list[Contender]) -> list[list[str]]:
    by_name = {c.name: c for c in contenders}
    ours = by_name[SPARKTRAIN].median()
    floor = by_name[FLOOR].median()
    rows = []
    for c in contenders:
        med = c.median()
        if med is None:
            rows.append([c.name, c.status or "no timed runs", "", "", "", ""])
            continue
        rows.append([
            c.name, f"{med:.3f}", f"{min(c.times):.3f}", f"{max(c.times):.3f}",
            f"{med / ours:.2f}x" if ours else "n/a",
            f"{med / floor:.2f}x" if floor else "n/a",
        ])
    return rows


HEADER = ["contender", "median s", "min s", "max s", "ratio to sparktrain", "ratio to floor"]


def target_line(contenders: list[Contender]) -> str:
    by_name = {c.name: c for c in contenders}
    ours, tf = by_name[SPARKTRAIN].median(), by_name[TF_PEER].median()
    if ours is None:
        return "targets: sparktrain.run has no numbers"
    met = "yes" if ours <= TARGET_MEDIAN_S else "NO"
    parts = [f"sparktrain median {ours:.3f} s <= {TARGET_MEDIAN_S} s: {met}"]
    if tf is None:
        parts.append(f"{TF_PEER}/sparktrain >= {TARGET_SPEEDUP_VS_TF:g}x: not measured")
    else:
        ratio = tf / ours
        parts.append(f"{TF_PEER}/sparktrain = {ratio:.2f}x >= {TARGET_SPEEDUP_VS_TF:g}x: "
                     f"{'yes' if ratio >= TARGET_SPEEDUP_VS_TF else 'NO'}")
    return "targets: " + "; ".join(parts)


def warmup_line(contenders: list[Contender]) -> str:
    parts = [f"{c.name} {c.warmup_s:.3f}" for c in contenders if c.warmup_s is not None]
    return "untimed warm-up (first run in the session), s: " + (", ".join(parts) or "none")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=8, help="timed runs per contender (default 8)")
    p.add_argument("--master", default="local[3]", help="Spark master of the session this script creates")
    p.add_argument("--num-proc", type=int, default=3, help="ranks per run (default 3)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one run may take before its jobs are cancelled and it counts as failed")
    p.add_argument("--write", metavar="PATH",
                   help="write or replace the launch-overhead section of this markdown file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_proc < 1:
        p.error("--repeats and --num-proc must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))

    # The ranks must run this interpreter, where sparktrain and the peers are installed.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # Only quiets TensorFlow's C++ logging in the ranks; the JVM passes the environment on.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A root handler at WARNING keeps the peers' per-run INFO lines out of the table's way.
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparktrain-launch-overhead")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        contenders = build_contenders(spark, args.num_proc)
        benchmark(spark, contenders, args.repeats, args.timeout)
    finally:
        machine = machine_line(("sparktrain", "spark-tensorflow-distributor", "tensorflow", "torch"), args.master)
        spark.stop()

    rows = table_rows(contenders)
    targets = target_line(contenders)
    warmups = warmup_line(contenders)
    print()
    print(f"launch overhead, {args.num_proc} ranks, {args.repeats} timed runs each (after one warm-up)")
    print(f"machine: {machine}")
    print()
    print(text_table(HEADER, [r if r[2] else r[:2] for r in rows]))
    print()
    print(targets)
    print(warmups)
    if args.write:
        intro = (f"Wall time of one no-op run on {args.num_proc} ranks, each as one barrier stage of the same warm "
                 f"SparkSession: one untimed warm-up per contender, then {args.repeats} timed runs each, in a block "
                 "per contender. Ratios are medians over medians. Written by `benchmarks/launch_overhead.py`.")
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Launch overhead", intro, machine, command, HEADER, rows,
            after_table=[targets.replace("targets:", "Targets:", 1), warmups.replace("untimed", "Untimed", 1)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
