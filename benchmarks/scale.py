#!/usr/bin/env python
"""The driver at 64, 256 and 1,024 ranks: simulated ranks (``tests/simranks.py``) against the real driver.

Each size runs in a fresh driver process of its own (so its peak RSS is its own); the simulated
ranks run in ``--processes`` other processes, so the driver's CPU time (``getrusage`` of its own
process) counts the driver alone. The driver is the real one: ``Attempt`` with its
``DriverServer`` (AES-256-GCM channel), supervision core, stall watch and display, the job being
the simulated ranks in place of a Spark stage. Two attempts per size:

1. every rank checks in; 3 s of beats alone; every rank prints its share of ``--lines`` lines as
   fast as the driver takes them (to a sink that counts them: the driver writes every line); a
   stall (every rank but the last waits in a collective; the last one's stack is asked for);
   one rank fails, and every rank is told to stop;
2. every rank checks in; one host (``--per-host`` ranks) falls silent; the driver notices after
   ``heartbeat_timeout`` and tells every other rank to stop.

    python benchmarks/scale.py [--sizes 64 256 1024] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shlex
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

from common import machine_line, text_table, write_section  # noqa: E402

SECTION_BEGIN = "<!-- scale:begin -->"
SECTION_END = "<!-- scale:end -->"
IDLE_SECONDS = 3.0
HEARTBEAT_TIMEOUT = 2.0


class Sink:
    """Where the driver writes the ranks' lines: counted, then dropped."""

    def __init__(self):
        self.lines = 0
        self.reached = threading.Event()
        self.target = -1

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        if self.lines >= self.target >= 0:
            self.reached.set()
        return len(text)

    def flush(self) -> None:
        pass


class Records(logging.Handler):
    """The driver's log records, so the benchmark sees when all ranks started and when a stall was told."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.started = threading.Event()
        self.stall = threading.Event()

    def emit(self, record) -> None:
        text = record.getMessage()
        if "rank(s) started in" in text:
            self.started.set()
        elif "stall:" in text:
            self.stall.set()


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def threads_fds() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir("/proc/self/fd"))


def attempt(n: int, processes: int, per_host: int, heartbeat: float, script, results: dict):
    """One attempt of ``n`` simulated ranks; ``script(job, sink, records)`` drives it from another thread."""
    from simranks import SimJob
    from sparktrain.driver.supervise.attempt import Attempt, RunInfo
    from sparktrain.errors import SparkTrainError
    from sparktrain.seam.spec import TaskSpec

    spec = TaskSpec(run_id="scale", size=n, payload=b"", secret=b"", driver_address=("127.0.0.1", 0), use_gpu=False,
                    output_ranks=None, max_result_bytes=0, start_timeout=300.0, grace_period=2.0, user_env={},
                    heartbeat_timeout=heartbeat, stall_warning=1.0, encrypted=True)
    sink = Sink()
    records = Records()
    logger = logging.getLogger("sparktrain")
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    jobs: list[SimJob] = []

    def make_job(spec, on_done):
        job = SimJob(spec, on_done, processes=processes, per_host=per_host, go=False)
        jobs.append(job)
        threading.Thread(target=script, args=(job, sink, records), daemon=True).start()
        return job

    info = RunInfo("scale", "sim_train", sink, sink, False, None, verbose=1)
    try:
        Attempt(info, spec, 1, make_job, "127.0.0.1").supervise()
    except SparkTrainError as e:
        results.setdefault("error", str(e).splitlines()[0])
    finally:
        logger.removeHandler(records)
        for job in jobs:
            job.kill()
    return jobs[0]


def one(n: int, lines: int, processes: int, per_host: int) -> dict:
    """Both attempts at ``n`` ranks, in this process: what the driver took."""
    out: dict = {"ranks": n}

    def check_in(job, records, into: dict) -> None:
        job._ready.wait(60)
        c0 = cpu()
        t0 = job.go()
        if not records.started.wait(300):
            raise RuntimeError("the ranks did not all check in")
        into["checkin_s"] = time.monotonic() - t0
        into["checkin_cpu"] = cpu() - c0

    def first(job, sink, records):
        try:
            check_in(job, records, out)
            time.sleep(0.5)  # the peers reach every rank, their first beats come
            out["threads"], out["fds"] = threads_fds()
            c0 = cpu()
            time.sleep(IDLE_SECONDS)
            out["beat_cpu"] = cpu() - c0
            each = max(1, lines // n)
            sink.target = sink.lines + each * n
            c0, t0 = cpu(), time.monotonic()
            job.tell({"cmd": "print", "lines": each})
            if not sink.reached.wait(600):
                raise RuntimeError(f"only {sink.lines} of {sink.target} lines arrived")
            out["lines"] = each * n
            out["print_s"] = time.monotonic() - t0
            out["print_cpu"] = cpu() - c0
            t0 = time.monotonic()
            job.tell({"cmd": "stall", "n": 5, "late": [n - 1]})
            if records.stall.wait(60):
                out["stall_s"] = time.monotonic() - t0
            job.tell({"cmd": "fail", "rank": n // 2})
        except Exception as e:  # noqa: BLE001 - reported in the row; the run is ended
            out["script_error"] = repr(e)
            job.cancel()

    job = attempt(n, processes, per_host, 8.0, first, out)
    aborted = job.aborted()
    failed_at = job.reported("failed_at")
    if failed_at is not None and aborted:
        out["stop_all_s"] = max(aborted.values()) - failed_at
        out["stopped"] = len(aborted)

    second: dict = {}

    def silence(job, sink, records):
        try:
            check_in(job, records, second)
            time.sleep(0.5)
            job.tell({"cmd": "silence", "host": job.hosts[n - 1]})
        except Exception as e:  # noqa: BLE001
            second["script_error"] = repr(e)
            job.cancel()

    job = attempt(n, processes, per_host, HEARTBEAT_TIMEOUT, silence, second)
    silenced_at = job.reported("silenced_at")
    others = [t for r, t in job.aborted().items() if job.hosts[r] != job.hosts[n - 1]]
    if silenced_at is not None and others:
        out["silent_noticed_s"] = min(others) - silenced_at
        out["silent_all_stopped_s"] = max(others) - silenced_at
    out["checkin2_s"] = second.get("checkin_s")
    out["errors"] = [out.pop("error", None), second.get("error")]
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


HEADER = ["ranks", "check-in s", "check-in CPU ms/rank", "beats CPU us/rank/s", "threads", "fds",
          "lines/s written", "CPU us/line", "stall told s", "failure to all stopped s",
          f"silent host noticed s (timeout {HEARTBEAT_TIMEOUT:g})", "peak RSS MB"]


def row(r: dict) -> list[str]:
    n = r["ranks"]

    def f(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    return [str(n), f"{r['checkin_s']:.2f} / {r['checkin2_s']:.2f}" if r.get("checkin2_s") else f("checkin_s", ".2f"),
            format(r["checkin_cpu"] / n * 1e3, ".2f") if "checkin_cpu" in r else "-",
            format(r["beat_cpu"] / n / IDLE_SECONDS * 1e6, ".0f") if "beat_cpu" in r else "-",
            f("threads", "d"), f("fds", "d"),
            format(r["lines"] / r["print_s"], ",.0f") if "print_s" in r else "-",
            format(r["print_cpu"] / r["lines"] * 1e6, ".1f") if "print_cpu" in r else "-",
            f("stall_s", ".2f"), f("stop_all_s", ".3f"), f("silent_noticed_s", ".2f"), f("peak_rss_mb", ".0f")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--lines", type=int, default=51200, help="output lines in all, shared among the ranks")
    p.add_argument("--processes", type=int, default=4, help="processes the simulated ranks share")
    p.add_argument("--per-host", type=int, default=8, help="simulated ranks per host")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--write", metavar="PATH", help="write or replace the scale section of this markdown file")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.lines, args.processes, args.per_host)))
        return 0
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))
    results = []
    for n in args.sizes:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n), "--lines", str(args.lines),
                               "--processes", str(args.processes), "--per-host", str(args.per_host)],
                              stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report(results, args, command)
    return 0


def report(results: list[dict], args, command: str) -> None:
    """Print the table of ``results`` (one dict per size) and write it where ``args.write`` says."""
    machine = machine_line(("sparktrain",))
    rows = [row(r) for r in results]
    print(f"\n{args.processes} processes of simulated ranks, {args.per_host} per host, encrypted channel")
    print(f"machine: {machine}\n")
    print(text_table(HEADER, rows))
    if args.write:
        base = results[0]
        ratios = []
        for r in results[1:]:
            if "print_cpu" in r and "print_cpu" in base:
                ratios.append(f"{r['ranks']} ranks against {base['ranks']}: CPU per line "
                              f"{(r['print_cpu'] / r['lines']) / (base['print_cpu'] / base['lines']):.2f}x, "
                              f"check-in CPU per rank {(r['checkin_cpu'] / r['ranks']) / (base['checkin_cpu'] / base['ranks']):.2f}x, "
                              f"beat CPU per rank {(r['beat_cpu'] / r['ranks']) / (base['beat_cpu'] / base['ranks']):.2f}x")
        intro = ("The real driver (`Attempt`, `DriverServer` on an AES-256-GCM channel, the supervision core, the stall "
                 "watch, the display) against simulated ranks speaking the real protocol over real sockets "
                 f"(`tests/simranks.py`, {args.processes} processes), without Spark. CPU is the driver process's own "
                 "(`getrusage`). Check-in: from the ranks' go to the driver's \"all started\" (both attempts). Lines: "
                 f"{args.lines:,} in all, every rank its share as fast as the driver takes them, every line written. "
                 "Stall told: from the stall to the driver's report (stall_warning 1 s, the late rank's stack asked "
                 "for). Failure to all stopped: from one rank's failure report to the last rank told to stop. Silent "
                 f"host: from a host's {args.per_host} ranks falling silent to the first other rank told to stop "
                 f"(heartbeat_timeout {HEARTBEAT_TIMEOUT:g} s, beats every 1 s). Written by `benchmarks/scale.py`.")
        write_section(args.write, SECTION_BEGIN, SECTION_END, "The driver at many ranks", intro, machine, command,
                      HEADER, rows, after_table=["Per rank and per line against the smallest size: " +
                                                 "; ".join(ratios) + "." if ratios else ""])


if __name__ == "__main__":
    sys.exit(main())
