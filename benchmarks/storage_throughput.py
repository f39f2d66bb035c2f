#!/usr/bin/env python
"""Upload and download throughput of 256 MiB to Azurite: sparktrain.storage next to adlfs directly.

Each measurement runs in a fresh process so its peak RSS is its own. sparktrain.storage streams
a local file (``put_file``/``get_file``, atomic and verified); adlfs directly moves the bytes held
in memory (``fs.pipe``/``fs.cat``). Needs Azurite (``npm install --prefix .node azurite``).

    python benchmarks/storage_throughput.py [--size-mib 256] [--repeats 3] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine_line, text_table, write_section  # noqa: E402
from storage_servers import Azurite  # noqa: E402 - the test suite's Azurite launcher

SECTION_BEGIN = "<!-- storage_throughput:begin -->"
SECTION_END = "<!-- storage_throughput:end -->"

ONE_RUN = r"""
import os, resource, sys, time
from sparktrain import storage
how, direction, url, options, local = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4]), sys.argv[5]
fs, path = storage.filesystem(url, options)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if how == "sparktrain" and direction == "up":
    storage.put_file(local, url, options)
elif how == "sparktrain":
    storage.get_file(url, local + ".down", options)
elif direction == "up":
    with open(local, "rb") as f:
        data = f.read()
    start = time.perf_counter()  # adlfs is timed from bytes in memory
    fs.pipe(path, data)
else:
    data = fs.cat(path)
elapsed = time.perf_counter() - start
print(elapsed, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def one(how: str, direction: str, url: str, options: dict, local: str) -> tuple[float, float]:
    proc = subprocess.run([sys.executable, "-c", ONE_RUN, how, direction, url, repr(options), local],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    seconds, rss = map(float, proc.stdout.split())
    return seconds, rss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", metavar="PATH", help="write or replace the storage section of this markdown file")
    args = p.parse_args(argv)
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))

    from sparktrain import storage

    server = Azurite()
    server.start()
    workdir = tempfile.mkdtemp(prefix="storage-bench-")
    try:
        options = server.options()
        fs, _ = storage.filesystem("abfs://x", options)
        container = f"bench-{uuid.uuid4().hex[:8]}"
        fs.mkdir(container)
        local = os.path.join(workdir, "data.bin")
        block = os.urandom(1 << 20)
        with open(local, "wb") as f:
            for _ in range(args.size_mib):
                f.write(block)
        results = {}
        for r in range(args.repeats):
            for how in ("sparktrain", "adlfs"):
                url = f"abfs://{container}/{how}-{r}.bin"
                for direction in ("up", "down"):
                    results.setdefault((how, direction), []).append(one(how, direction, url, options, local))
    finally:
        server.stop()

    rows = []
    for direction, label in (("up", "upload"), ("down", "download")):
        direct = statistics.median(args.size_mib / s for s, _ in results[("adlfs", direction)])
        for how, name in (("sparktrain", "sparktrain.storage"), ("adlfs", "adlfs directly")):
            speeds = [args.size_mib / s for s, _ in results[(how, direction)]]
            rss = max(m for _, m in results[(how, direction)])
            rows.append([f"{label}: {name}", f"{statistics.median(speeds):.0f}", f"{min(speeds):.0f}",
                         f"{max(speeds):.0f}", f"{statistics.median(speeds) / direct:.2f}x", f"{rss:.0f}"])
    header = ["contender", "median MiB/s", "min", "max", "ratio to adlfs", "peak RSS growth MiB"]
    machine = machine_line(("sparktrain", "adlfs", "fsspec"))
    print(f"\n{args.size_mib} MiB to Azurite on 127.0.0.1, {args.repeats} runs each, a fresh process per run")
    print(f"machine: {machine}\n")
    print(text_table(header, rows))
    if args.write:
        intro = (f"{args.size_mib} MiB to Azurite on 127.0.0.1, {args.repeats} runs each, each run in a fresh "
                 "process so its peak RSS growth is its own. sparktrain.storage streams a local file "
                 "(put_file/get_file: atomic, with a checksum); adlfs directly moves bytes already in memory "
                 "(fs.pipe/fs.cat). Written by `benchmarks/storage_throughput.py`.")
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Storage throughput", intro, machine, command,
                      header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
