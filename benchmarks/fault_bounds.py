#!/usr/bin/env python
"""How fast each injected fault surfaces or is cleaned up: the fault suite, run N times, medians.

Runs ``tests/test_faults.py`` and ``tests/test_faults_cluster.py`` (real local[4] and
local-cluster[3,1,1024] Spark, real TensorFlow ranks) ``--repeats`` times. Each scenario writes
the time it measured (the fault injected -> ``run`` raised, or -> every rank process gone) to a
file this script names in ``SPARKTRAIN_FAULT_TIMES``; the table shows each scenario's bound and
the median, min and max of its runs.

    python benchmarks/fault_bounds.py [--repeats 3] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from common import machine_line, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- fault_bounds:begin -->"
SECTION_END = "<!-- fault_bounds:end -->"
SUITES = ["tests/test_faults.py", "tests/test_faults_cluster.py"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", help="update this RESULTS.md")
    args = parser.parse_args(argv)
    command = "python benchmarks/fault_bounds.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    times: dict[str, list[float]] = {}
    bounds: dict[str, float] = {}
    failed_runs = 0
    for repeat in range(args.repeats):
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            path = f.name
        env = dict(os.environ, SPARKTRAIN_FAULT_TIMES=path)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        print(f"run {repeat + 1}/{args.repeats}: {proc.stdout.strip().splitlines()[-1]}")
        failed_runs += proc.returncode != 0
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                times.setdefault(rec["scenario"], []).append(rec["seconds"])
                bounds[rec["scenario"]] = rec["bound"]
        os.remove(path)

    header = ["scenario", "bound s", "median s", "min s", "max s", "runs", "median / bound"]
    rows = []
    for scenario, values in times.items():
        median = statistics.median(values)
        rows.append([scenario, f"{bounds[scenario]:g}", f"{median:.2f}", f"{min(values):.2f}",
                     f"{max(values):.2f}", str(len(values)), f"{median / bounds[scenario]:.2f}"])
    machine = machine_line(("sparktrain", "tensorflow"), master="local[4] and local-cluster[3,1,1024]")
    print(f"\nfault suite, {args.repeats} runs\nmachine: {machine}\n")
    print(text_table(header, rows))
    if args.write:
        intro = ("Each scenario of the fault-injection suite (`tests/test_faults.py`, `tests/test_faults_cluster.py`) "
                 "on a real local Spark with real TensorFlow ranks: the time from the injected fault to `run` "
                 "raising (or, for cancellation, to every rank process being gone, checked by pid), against the "
                 f"scenario's bound. Median of {args.repeats} runs of the suite. Written by "
                 "`benchmarks/fault_bounds.py`.")
        notes = [f"{failed_runs} of {args.repeats} suite runs had a failing test."] if failed_runs else []
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Fault bounds", intro, machine, command,
                      header, rows, after_table=notes)
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
