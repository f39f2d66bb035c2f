#!/usr/bin/env python
"""Allreduce bandwidth of ``sparktrain.tensorflow.allreduce`` on 3 ranks, eager and inside a tf.function.

One ``sparktrain.run`` (local mode by default: ``--num-proc`` processes on this machine, no
Spark; ``--spark`` launches through an embedded Spark session instead) starts the ranks. Each
rank, for every size (float32 tensors of 4 KiB to 64 MiB by default) and for each of two modes:

- ``eager``: ``hvd.allreduce(x, op=hvd.Sum)`` called eagerly (a new collective instance per call);
- ``tf.function``: the same call traced once into a ``tf.function`` (one collective instance,
  run again and again, as a training step does);
- ``in-step``: ``STEP_CALLS`` allreduces chained inside one ``tf.function`` (a ``tf.range``
  loop), timed per collective: what a collective costs inside a compiled ``model.fit`` step,
  without the Python-to-``tf.function`` dispatch that a per-call timing also counts;

waits at a barrier, runs ``--warmup`` untimed calls (the first traces the tf.function) and
checks the result (every element must be the number of ranks), then times ``--iters`` calls
one by one with ``time.perf_counter`` (fewer for sizes where ``--iters`` calls would take longer
than ``--budget`` seconds, at least ``--min-iters``; rank 0 decides and tells the others, so all
ranks run the same calls). The table gives rank 0's median time per call, the algorithm bandwidth
``algbw = bytes / time`` and the bus bandwidth ``busbw = algbw * 2(n-1)/n`` (what each rank's link
carries in a ring allreduce), in MB/s (10^6 bytes per second). tf.function is the primary
column: it is how gradients are reduced inside ``model.fit`` and a custom training step.

    python benchmarks/allreduce_bandwidth.py [--max-size 64M] [--write benchmarks/RESULTS.md]

``--compare`` measures the CPU engines side by side in one run instead, on 2 and 3 ranks: the
native engine called directly (shared memory, and the TCP ring forced with
``SPARKTRAIN_CPU_TRANSPORT=tcp``), the native engine through ``sparktrain.tensorflow.allreduce``
inside a ``tf.function`` (per call, and per collective inside a compiled step), TensorFlow's own ring
(``SPARKTRAIN_CPU_COLLECTIVES=tensorflow``) in a ``tf.function``, and Gloo
(``torch.distributed``, where torch is installed) and, with ``--mpi-python``, MPI (mpi4py with the
``mpich`` wheel, started by its ``mpiexec``) as the reference. Each size is timed call by call; the table
gives rank 0's median per call and busbw, and each contender's ratio to Gloo at that size
(``--contenders native-tcp,gloo`` measures only those)::

    python benchmarks/allreduce_bandwidth.py --compare --write benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time

from common import GlooGroup, HostSteal, machine_line, text_table, write_section

COMPARE_BEGIN = "<!-- cpu_engines:begin -->"
COMPARE_END = "<!-- cpu_engines:end -->"
SECTION_BEGIN = "<!-- allreduce_bandwidth:begin -->"
SECTION_END = "<!-- allreduce_bandwidth:end -->"

MODES = ("tf.function", "eager", "in-step")
#: What --compare can measure (--contenders picks some).
CONTENDERS = ("native", "native-tcp", "tf-native", "tf-native-step", "tf-ring", "gloo", "mpi")
#: Collectives chained inside one tf.function call in the ``in-step`` mode.
STEP_CALLS = 50


# -- what the ranks run (self-contained: cloudpickle ships it by value) --------------------------

def measure(sizes: list[int], modes: list[str], op_name: str, warmup: int, iters: int, min_iters: int,
            budget: float) -> list[dict]:
    """Every rank runs this; rank 0's timings come back to the driver."""
    import statistics

    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init()
    op = hvd.Sum if op_name == "sum" else hvd.Average
    expected = float(hvd.size()) if op == hvd.Sum else 1.0
    results = []
    for nbytes in sizes:
        x = tf.ones([nbytes // 4], tf.float32)
        row: dict = {"bytes": nbytes}
        for mode in modes:
            per = 1
            if mode == "eager":
                def call(t):
                    return hvd.allreduce(t, op=op)
            elif mode == "in-step":
                per = STEP_CALLS

                @tf.function
                def call(t):
                    for _ in tf.range(STEP_CALLS):
                        # Each collective waits for the last; the values stay as they were.
                        t = hvd.allreduce(t, op=op) - t * (expected - 1.0)
                    return t
            else:
                # A fresh tf.function per size: traced once (in the warm-up), one collective instance.
                call = tf.function(lambda t: hvd.allreduce(t, op=op))
            hvd.barrier()
            warm = []
            for _ in range(warmup):
                start = time.perf_counter()
                out = call(x)
                warm.append(time.perf_counter() - start)
            lo, hi = float(tf.reduce_min(out)), float(tf.reduce_max(out))
            want = 1.0 if mode == "in-step" else expected
            if lo != want or hi != want:
                raise RuntimeError(f"{mode} allreduce of {nbytes} bytes gave values in [{lo}, {hi}], "
                                   f"expected {want}")
            # Every rank must issue the same calls: rank 0 picks the count and broadcasts it.
            per_call = min(warm[1:]) if len(warm) > 1 else warm[0]  # the first call may include tracing
            count = max(min_iters, min(iters, int(budget / max(per_call, 1e-9))))
            count = int(hvd.broadcast(tf.constant([count], tf.int32), root_rank=0).numpy()[0])
            hvd.barrier()
            times = []
            for _ in range(count):
                start = time.perf_counter()
                call(x)
                times.append(time.perf_counter() - start)
            row[mode] = {"median": statistics.median(times) / per, "min": min(times) / per, "iters": count * per}
        results.append(row)
    return results


def _timed(call, count: int) -> dict:
    import statistics

    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "iters": count}


def worker(kind: str, rank: int, n: int, port: int, sizes: list[int], iters: int, budget: float) -> None:
    """One rank of a directly called engine (``native``, ``native-tcp`` or ``gloo``); rank 0 prints JSON.

    Zeros summed stay zeros, so the same buffer is reduced again and again in place.
    """
    import json

    import numpy as np

    if kind.startswith("native"):
        from sparktrain import engine

        comm = engine.Communicator(rank, n, ["127.0.0.1"] * n, [port + r for r in range(n)], b"bench", f"bench-{port}",
                                   timeout=300, force_tcp=kind == "native-tcp")

        def make(nbytes):
            x = np.zeros(nbytes // 4, np.float32)
            return lambda: comm.allreduce_(x, "sum")

        def agree(count):
            return int(comm.broadcast(np.array([count], np.int64), root=0)[0])

        check = comm.allreduce(np.ones(7, np.float32), "sum")
    elif kind == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, n = world.Get_rank(), world.Get_size()

        def make(nbytes):
            x = np.zeros(nbytes // 4, np.float32)
            return lambda: world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

        def agree(count):
            return int(world.bcast(count, root=0))

        check = np.ones(7, np.float32)
        world.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)
    else:
        group = GlooGroup(f"tcp://127.0.0.1:{port}", rank, n)
        make, agree = group.make, group.agree
        ones = group.torch.ones(7)
        group.dist.all_reduce(ones)
        check = ones.numpy()
    if not (check == n).all():
        raise RuntimeError(f"{kind}: 7 ones summed over {n} ranks gave {check}")
    results = []
    for nbytes in sizes:
        call = make(nbytes)
        for _ in range(2):
            call()
        start = time.perf_counter()
        call()
        count = agree(max(3, min(iters, int(budget / max(time.perf_counter() - start, 1e-9)))))
        results.append({"bytes": nbytes, "tf.function": _timed(call, count)})
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    if kind.startswith("native"):
        comm.close()
    elif kind == "gloo":
        group.close()


def run_mpi(python: str, n: int, sizes: list[int], iters: int, budget: float, timeout: float) -> list[dict]:
    """The reference: mpi4py's Allreduce, started by the ``mpiexec`` beside ``python`` (the mpich wheel's)."""
    import json
    import subprocess

    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    out = subprocess.run([mpiexec, "-n", str(n), python, os.path.abspath(__file__), "--worker", "mpi", "0", str(n), "0",
                          ",".join(map(str, sizes)), str(iters), str(budget)], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"mpiexec exited with {out.returncode}: {out.stderr.strip()[-200:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def run_workers(kind: str, n: int, sizes: list[int], iters: int, budget: float, timeout: float) -> list[dict]:
    import json
    import socket
    import subprocess

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # gloo's store; the native ranks take port + rank (none listens on one host)
    s.close()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kind == "native-tcp":  # the leaders listen on port + rank
        env["SPARKTRAIN_CPU_TRANSPORT"] = "tcp"
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind, str(r), str(n), str(port),
                               ",".join(map(str, sizes)), str(iters), str(budget)], stdout=subprocess.PIPE,
                              env=env, text=True) for r in range(n)]
    out = ""
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        if p.returncode != 0:
            raise RuntimeError(f"{kind} on {n} ranks: a rank exited with {p.returncode}")
    line = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def compare(args, command: str) -> int:
    """Every CPU engine beside the others, on 2 and 3 ranks, in this one run."""
    from importlib import util

    import sparktrain
    from common import settle

    sizes = sizes_between(args.min_size, args.max_size, args.factor)
    contenders = [("native, shared memory", "native"), ("native, forced TCP", "native-tcp"),
                  ("native in tf.function (sparktrain.tensorflow)", "tf-native"),
                  (f"native inside a compiled step ({STEP_CALLS} per tf.function)", "tf-native-step"),
                  ("TensorFlow ring in tf.function", "tf-ring")]
    if util.find_spec("torch") is not None:
        contenders.append(("Gloo (torch.distributed)", "gloo"))
    if args.mpi_python:
        contenders.append(("MPI (mpi4py, mpich, mpiexec)", "mpi"))
    if args.contenders:
        contenders = [(label, kind) for label, kind in contenders if kind in args.contenders]
    table: dict = {}
    steal = HostSteal()
    for n in args.ranks:
        for label, kind in contenders:
            settle()
            started = time.perf_counter()
            try:
                if kind == "mpi":
                    res = run_mpi(args.mpi_python, n, sizes, args.iters, args.budget, args.timeout)
                elif kind.startswith("tf-"):
                    env = {"TF_CPP_MIN_LOG_LEVEL": "3",
                           "SPARKTRAIN_CPU_COLLECTIVES": "tensorflow" if kind == "tf-ring" else "native"}
                    mode = "in-step" if kind.endswith("-step") else "tf.function"
                    res = sparktrain.run(measure, args=(sizes, [mode], "sum", args.warmup, args.iters,
                                                        args.min_iters, args.budget),
                                         num_proc=-n, env=env, verbose=0, output_ranks=[0], stdout=sys.stderr,
                                         timeout=args.timeout)
                    res = [{"bytes": r["bytes"], "tf.function": r[mode]} for r in res]
                else:
                    try:
                        res = run_workers(kind, n, sizes, args.iters, args.budget, args.timeout)
                    except RuntimeError:  # the free port we picked was taken before a rank bound it
                        res = run_workers(kind, n, sizes, args.iters, args.budget, args.timeout)
                table[(n, kind)] = {r["bytes"]: r["tf.function"] for r in res}
            except Exception as e:  # noqa: BLE001 - a contender that fails is reported, not fatal
                table[(n, kind)] = str(e).splitlines()[0][:150]
            print(f"{label}, {n} ranks: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    cols = ["ranks", "size", "contender", "iters", "median us", "busbw MB/s", "x Gloo"]
    rows = []
    for n in args.ranks:
        for nbytes in sizes:
            gloo = table.get((n, "gloo"))
            for label, kind in contenders:
                m = table[(n, kind)]
                if isinstance(m, str):
                    rows.append([str(n), size_label(nbytes), label, f"failed: {m}"])
                    continue
                t = m[nbytes]["median"]
                busbw = nbytes / t * 2 * (n - 1) / n / 1e6
                ratio = f"{gloo[nbytes]['median'] / t:.2f}" if isinstance(gloo, dict) else "-"
                rows.append([str(n), size_label(nbytes), label, str(m[nbytes]["iters"]), f"{t * 1e6:,.1f}",
                             f"{busbw:,.1f}", ratio])
    machine = machine_line(("sparktrain", "tensorflow", "torch"))
    method = (f"float32 sum, {args.warmup} warm-up call(s), then up to {args.iters} timed calls per size (at least "
              f"{args.min_iters}, fewer where they would exceed {args.budget:g} s); rank 0's median per call. "
              "x Gloo = Gloo's time / this contender's time at that size and rank count. "
              f"Host steal over the run: {steal.share():.1%} of the machine's CPU time (/proc/stat).")
    if args.mpi_python:
        import subprocess

        probe = "from importlib.metadata import version as v; print(v('mpi4py'), v('mpich'))"
        found = subprocess.run([args.mpi_python, "-c", probe], capture_output=True, text=True).stdout.split()
        if len(found) == 2:
            method += f" MPI: mpi4py {found[0]}, mpich {found[1]}, over shared memory (its default on one host)."
    print()
    print("CPU collective engines")
    print(f"machine: {machine}")
    print(method)
    print()
    print(text_table(cols, rows))
    if args.write:
        write_section(
            args.write, COMPARE_BEGIN, COMPARE_END, "CPU collective engines",
            "Allreduce per call and busbw (= bytes / time x 2(n-1)/n, MB/s) of sparktrain's native engine beside "
            "TensorFlow's ring and Gloo, all measured in the same run. Written by "
            "`benchmarks/allreduce_bandwidth.py --compare`.",
            machine, command, cols, rows, before_command=[method], first_left=False)
    return 0


# -- driver side ---------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'4K', '64M', '1GiB', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4K, 1M, 64M)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_label(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def sizes_between(lo: int, hi: int, factor: int) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def header(modes: list[str]) -> list[str]:
    cols = ["size", "float32 elements"]
    for mode in modes:
        cols += [f"{mode} iters", f"{mode} median ms", f"{mode} algbw MB/s", f"{mode} busbw MB/s"]
    return cols


def table_rows(results: list[dict], modes: list[str], n: int) -> list[list[str]]:
    rows = []
    for row in results:
        cells = [size_label(row["bytes"]), f"{row['bytes'] // 4:,}"]
        for mode in modes:
            m = row[mode]
            algbw = row["bytes"] / m["median"] / 1e6
            cells += [str(m["iters"]), f"{m['median'] * 1e3:.3f}", f"{algbw:,.1f}", f"{algbw * 2 * (n - 1) / n:,.1f}"]
        rows.append(cells)
    return rows


def summary_line(results: list[dict], modes: list[str], n: int) -> str:
    mode = modes[0]
    best = max(results, key=lambda r: r["bytes"] / r[mode]["median"])
    small = results[0]
    busbw = best["bytes"] / best[mode]["median"] * 2 * (n - 1) / n / 1e6
    return (f"{mode}: peak busbw {busbw:,.1f} MB/s at {size_label(best['bytes'])}; "
            f"{size_label(small['bytes'])} takes {small[mode]['median'] * 1e3:.3f} ms per call (latency)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-size", type=parse_size, default=parse_size("4K"), help="smallest tensor (default 4K)")
    p.add_argument("--max-size", type=parse_size, default=parse_size("64M"), help="largest tensor (default 64M)")
    p.add_argument("--factor", type=int, default=4, help="each size is this many times the last (default 4)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and mode (default 20)")
    p.add_argument("--min-iters", type=int, default=3,
                   help="timed calls per size and mode even when they exceed --budget (default 3)")
    p.add_argument("--budget", type=float, default=10.0, metavar="S",
                   help="time fewer than --iters calls where they would take longer than S seconds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size and mode first (default 2)")
    p.add_argument("--mode", choices=("all", *MODES), default="all",
                   help="tf.function, eager, in-step or all (default all; tf.function is the primary column)")
    p.add_argument("--op", choices=("sum", "average"), default="sum", help="reduction (default sum)")
    p.add_argument("--num-proc", type=int, default=3, help="ranks (default 3)")
    p.add_argument("--spark", action="store_true",
                   help="launch through an embedded Spark session (--master) instead of local processes")
    p.add_argument("--master", default="local[3]", help="master of the embedded session with --spark (default local[3])")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the whole run may take (default 900)")
    p.add_argument("--compare", action="store_true",
                   help="measure the CPU engines side by side (native, TensorFlow's ring, Gloo) on --ranks")
    p.add_argument("--mpi-python", metavar="PYTHON",
                   help="with --compare, also measure MPI: a Python with mpi4py whose bin/ holds mpiexec "
                        "(pip install mpi4py mpich in a separate venv)")
    p.add_argument("--ranks", type=lambda v: [int(x) for x in v.split(",")], default=[2, 3],
                   help="rank counts for --compare (default 2,3)")
    p.add_argument("--contenders", type=lambda v: v.split(","), metavar="KINDS",
                   help="with --compare, only these (comma-separated): " + ", ".join(CONTENDERS) + " (default all)")
    p.add_argument("--write", metavar="PATH",
                   help="write or replace the allreduce-bandwidth section of this markdown file")
    args = p.parse_args(argv)
    if args.contenders and set(args.contenders) - set(CONTENDERS):
        p.error(f"--contenders: no {', '.join(sorted(set(args.contenders) - set(CONTENDERS)))}; "
                f"choose from {', '.join(CONTENDERS)}")
    if args.min_size < 4 or args.min_size % 4 or args.max_size < args.min_size:
        p.error("sizes must be multiples of 4 bytes (float32) with --min-size <= --max-size")
    if args.factor < 2:
        p.error("--factor must be at least 2")
    if args.num_proc < 2:
        p.error("--num-proc must be at least 2: an allreduce on one rank moves nothing")
    if args.warmup < 1 or args.min_iters < 1 or args.iters < args.min_iters:
        p.error("--warmup and --min-iters must be at least 1, and --iters at least --min-iters")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, rank, n, port, sizes, iters, budget = argv[1:8]
        worker(kind, int(rank), int(n), int(port), [int(x) for x in sizes.split(",")], int(iters), float(budget))
        return 0
    args = parse_args(argv)
    command = shlex.join([sys.executable, sys.argv[0], *argv])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    if args.compare:
        return compare(args, command)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    sizes = sizes_between(args.min_size, args.max_size, args.factor)

    import sparktrain

    spark = None
    if args.spark:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(args.master).appName("sparktrain-allreduce-bandwidth")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    try:
        results = sparktrain.run(
            measure, args=(sizes, modes, args.op, args.warmup, args.iters, args.min_iters, args.budget),
            num_proc=args.num_proc if args.spark else -args.num_proc, env={"TF_CPP_MIN_LOG_LEVEL": "3"},
            verbose=0, output_ranks=[0], stdout=sys.stderr, timeout=args.timeout)
    finally:
        if spark is not None:
            spark.stop()
    print(f"run took {time.perf_counter() - started:.1f} s", file=sys.stderr)

    n = args.num_proc
    cols, rows = header(modes), table_rows(results, modes, n)
    machine, summary = machine_line(("sparktrain", "tensorflow"), args.master if args.spark else None), summary_line(results, modes, n)
    method = (f"{n} ranks, op {args.op}, {args.warmup} untimed warm-up call(s) then up to {args.iters} timed "
              f"calls per size and mode (at least {args.min_iters}; fewer than {args.iters} where they would "
              f"exceed {args.budget:g} s). Primary: {modes[0]}.")
    print()
    print(f"allreduce bandwidth, {n} ranks, {'Spark ' + args.master if args.spark else 'local mode'}")
    print(f"machine: {machine}")
    print(method)
    print()
    print(text_table(cols, rows))
    print()
    print(summary)
    if args.write:
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Allreduce bandwidth",
            "Time per `sparktrain.tensorflow.allreduce` call on float32 tensors, rank 0's median over the timed "
            "calls after a warm-up; algbw = bytes / time, busbw = algbw x 2(n-1)/n, in MB/s (10^6 B/s). "
            "Written by `benchmarks/allreduce_bandwidth.py`.",
            machine, command, cols, rows, before_command=[method], after_table=[summary[0].upper() + summary[1:]],
            first_left=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
