#!/usr/bin/env python
"""The engine's allreduce across 2, 4 and 8 simulated hosts against its cost model (docs/engine.md).

Each configuration brings up ``h`` simulated hosts (``tests/simhosts.py``: a network namespace,
hostname, private ``/dev/shm`` and a core each, shared where hosts outnumber cores; needs root),
shapes every host's link (tbf on both ends of its veth, ``--shape``, 1 Gbit/s by default), starts
``r`` ranks per host (numbered host by host, as sparktrain numbers them) and times the native
engine's allreduce of float32 zeros at each size (median of several calls after a warm-up).

The model (docs/engine.md, "Cost across hosts"): an allreduce of ``n`` bytes across ``h``
hosts costs

    T = L(n) + (h-1)·α + 2(h-1)·max(α, n/(h·B))

``α`` the time of one hop between leaders (a small message sent, received, woken for and passed
on), ``B`` the link's rate, ``L(n)`` the host's own phases: its ranks' buffers reduced into the
leader's and the result handed back (0 for one rank per host; for ``r`` ranks, the same allreduce
measured on one host of ``r`` ranks in the same run). ``(h-1)·α`` is the leaders' agreement on
the call (a ring of verdicts, one hop after another); the ring's 2(h-1) steps each carry an
``h``-th of the buffer, passed on as it arrives, so a step costs a hop's latency only where its
piece is sent faster than that. From 4 MiB with more than one rank per host the buffer goes in
1 MiB segments, each its own ring, overlapping the host's phases (native/pipeline.c): there the
model takes the larger of ``L(n)`` and the segments' rings. ``α`` is measured first, on the same
links: half the median round trip of a 64-byte TCP ping-pong (Python) between two hosts. The
kernel here has no ``netem``, so no delay can be added to a link: ``α`` is what the veths, the
bridge and the scheduler of 2 shared cores give, tens of microseconds, not a real network's.

The table gives, per hosts, ranks per host and size: the median time, the model's time and their
ratio, the algorithm bandwidth (n over the time) and its share of the ring's limit
(B·h/(2(h-1)), the most a ring can reach on links of rate B).

    sudo .venv/bin/python benchmarks/ring_hosts.py [--hosts 2,4,8] [--per-host 1,2] [--shape 1gbit] \\
        [--sizes 4K,64K,1M,4M,16M,64M] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from common import machine_line, text_table, write_section
from multihost import _results

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SECTION_BEGIN = "<!-- ring-hosts:begin -->"
SECTION_END = "<!-- ring-hosts:end -->"
PORT = 29500
RATES = {"1gbit": 125e6, "100mbit": 12.5e6, "10gbit": 1250e6}
PIPE_MIN_BYTES, PIPE_SEG_BYTES = 4 << 20, 1 << 20  # native/pipeline.c


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def show_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def iterations(nbytes: int) -> int:
    """Enough calls for a stable median, few where one call takes most of a second."""
    return max(3, min(200, (8 << 20) // max(nbytes, 1)))


def worker(rank: int, hosts: list[str], sizes: list[int]) -> None:
    """One rank: the median time of an allreduce at each size; rank 0 prints JSON."""
    import numpy as np

    from sparktrain import engine

    n = len(hosts)
    local = sum(1 for h in hosts if h == hosts[rank])
    # Each host has one core (or less): its ranks sleep at once, as sparktrain's budget makes them.
    comm = engine.Communicator(rank, n, hosts, [PORT + 1 + r for r in range(n)], b"bench", "ring-bench", timeout=300,
                               spin=0.0 if local > 1 else None)
    out = {}
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, np.float32)
        comm.allreduce_(x, "sum")  # the warm-up
        times = []
        for _ in range(iterations(nbytes)):
            start = time.perf_counter()
            comm.allreduce_(x, "sum")
            times.append(time.perf_counter() - start)
        out[str(nbytes)] = statistics.median(times)
    comm.close()
    if rank == 0:
        print("RESULTS " + json.dumps(out), flush=True)


def echo(ip: str, rounds: int) -> None:
    import socket

    with socket.create_server((ip, PORT)) as srv:
        print("LISTENING", flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(64)
        for _ in range(rounds):
            view = memoryview(buf)
            while view:
                view = view[conn.recv_into(view):]
            conn.sendall(buf)


def ping(ip: str, rounds: int) -> None:
    """Round trips of 64 bytes to ``echo``; prints the median round trip in seconds."""
    import socket

    conn = socket.create_connection((ip, PORT), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, times = bytearray(64), []
    for _ in range(rounds):
        start = time.perf_counter()
        conn.sendall(buf)
        view = memoryview(buf)
        while view:
            view = view[conn.recv_into(view):]
        times.append(time.perf_counter() - start)
    conn.close()
    print("RESULTS " + json.dumps({"rtt": statistics.median(times[rounds // 10:])}), flush=True)


def hop_seconds(sim, rounds: int = 3000) -> float:
    """α: half the median round trip of a 64-byte ping-pong from host 1 to host 0."""
    me = [sys.executable, os.path.abspath(__file__)]
    server = sim.popen(0, [*me, "--echo", sim.ips[0], str(rounds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if "LISTENING" not in server.stdout.readline():
        raise RuntimeError("the echo server did not start")
    client = sim.popen(1, [*me, "--ping", sim.ips[0], str(rounds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    rtt = _results(client, 120)["rtt"]
    server.communicate(timeout=30)
    return rtt / 2


def allreduce_times(sim, per_host: int, sizes: list[int]) -> dict[int, float]:
    """The median allreduce time at each size on ``sim``'s hosts with ``per_host`` ranks each."""
    me = [sys.executable, os.path.abspath(__file__)]
    hosts = [ip for ip in sim.ips for _ in range(per_host)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # One process per host starts its ranks, so that they share its /dev/shm, as a worker's tasks do.
    procs = [sim.popen(i, [*me, "--host-ranks", ",".join(str(i * per_host + k) for k in range(per_host)),
                           ",".join(hosts), ",".join(map(str, sizes))], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(sim.n)]
    try:
        got = _results(procs[0], 900)
    finally:
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pass
    return {int(k): v for k, v in got.items()}


def model_seconds(h: int, n: int, alpha: float, rate: float, local: float, pipelined: bool) -> float:
    """The model's time (docs/engine.md, "Cost across hosts")."""
    def ring(nbytes: int) -> float:
        return 2 * (h - 1) * max(alpha, nbytes / (h * rate))

    if not pipelined:
        return local + (h - 1) * alpha + ring(n)
    segments = -(-n // PIPE_SEG_BYTES)
    return (h - 1) * alpha + max(segments * ring(min(n, PIPE_SEG_BYTES)), local)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,4,8")
    p.add_argument("--per-host", default="1,2")
    p.add_argument("--shape", default="1gbit", choices=sorted(RATES))
    p.add_argument("--sizes", default="4K,64K,1M,4M,16M,64M")
    p.add_argument("--write", metavar="RESULTS_MD")
    p.add_argument("--host-ranks", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--echo", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--ping", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        rank, hosts, sizes = args.worker
        worker(int(rank), hosts.split(","), [int(s) for s in sizes.split(",")])
        return 0
    if args.host_ranks:
        ranks, hosts, sizes = args.host_ranks
        children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", r, hosts, sizes])
                    for r in ranks.split(",")]
        return max(c.wait() for c in children)
    if args.echo:
        echo(args.echo[0], int(args.echo[1]))
        return 0
    if args.ping:
        ping(args.ping[0], int(args.ping[1]))
        return 0

    import simhosts

    reason = simhosts.why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the finally blocks take hosts down
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    host_counts = sorted(map(int, args.hosts.split(",")))
    per_hosts = sorted(map(int, args.per_host.split(",")))
    rate = RATES[args.shape]
    rows, alpha = [], None
    local: dict[int, dict[int, float]] = {}
    for per in per_hosts:
        if per > 1:  # the host's own phases: the same allreduce on one host of `per` ranks
            sim = simhosts.SimHosts(1).up()
            try:
                local[per] = allreduce_times(sim, per, sizes)
            finally:
                sim.down()
        for h in host_counts:
            sim = simhosts.SimHosts(h).up()
            try:
                sim.shape_all(args.shape)
                if alpha is None:
                    alpha = hop_seconds(sim)
                    print(f"alpha (half a 64-byte round trip between two hosts): {alpha * 1e6:.0f} us", flush=True)
                got = allreduce_times(sim, per, sizes)
            finally:
                left = sim.down()
                if left:
                    print("left behind: " + "; ".join(left), file=sys.stderr)
            for n in sizes:
                base = local.get(per, {}).get(n, 0.0)
                want = model_seconds(h, n, alpha, rate, base, per > 1 and n >= PIPE_MIN_BYTES)
                limit = rate * h / (2 * (h - 1))
                rows.append([str(h), str(per), show_size(n), f"{got[n] * 1e3:.3f}", f"{want * 1e3:.3f}",
                             f"{got[n] / want:.2f}", f"{n / got[n] / 1e6:.1f}", f"{n / got[n] / limit:.2f}"])
            print(text_table(HEADER, rows[-len(sizes):]), flush=True)
    print()
    print(text_table(HEADER, rows))
    if args.write:
        machine = machine_line([]).replace("local mode (no Spark)", "no Spark")
        command = " ".join(["python", "benchmarks/ring_hosts.py", *sys.argv[1:]])
        note = (f"α measured here: {alpha * 1e6:.0f} µs (half the median round trip of a 64-byte TCP ping-pong "
                f"between two hosts, in Python); B = {rate / 1e6:.0f} MB/s ({args.shape}).")
        write_section(args.write, SECTION_BEGIN, SECTION_END, "The ring across hosts against its cost model",
                      INTRO, machine, command, HEADER, rows, before_command=[note])
    return 0


INTRO = (
    "The native engine's allreduce (float32, sum) across h simulated hosts (network namespaces on one bridge, a "
    "core each, shared where hosts outnumber the machine's 2 cores) with r ranks per host, every link shaped with "
    "tbf on both ends, against the cost model of docs/engine.md (\"Cost across hosts\"): "
    "T = L(n) + (h-1)α + 2(h-1)·max(α, n/(hB)), where L(n) is the same allreduce on one host of r ranks (0 for "
    "r = 1) and, from 4 MiB with r > 1, 1 MiB segments each pay the ring's steps and the larger of their sum and "
    "L(n) counts (the phases are pipelined). This kernel has no netem: no delay can be added, so α is the veths' "
    "and the scheduler's. Ring limit: algorithm bandwidth over B·h/(2(h-1)); tbf counts every byte of a frame, so "
    "TCP's payload gets at most 1448/1514 = 0.96 of it. Written by `benchmarks/ring_hosts.py`.")
HEADER = ["hosts", "ranks/host", "size", "ms", "model ms", "ms / model", "algbw MB/s", "algbw / ring limit"]


if __name__ == "__main__":
    sys.exit(main())
