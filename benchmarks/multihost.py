#!/usr/bin/env python
"""Collectives across simulated hosts: the native engine against Gloo and against the link.

Each configuration brings up simulated hosts (``tests/simhosts.py``: a network namespace, a
hostname, a private ``/dev/shm`` and a core each, on one bridge; needs root), numbers ranks host
by host, and runs in one go, on the same hosts:

- the raw link: one TCP stream from host 1 to host 0 (Python ``sendall``/``recv_into``), MB/s;
  and duplex: hosts 0 and 1 each sending to the other while receiving, one stream each way, as a
  ring's host does (its CPU carries both directions), the slower direction's MB/s;
- the native engine (``sparktrain.engine.Communicator``), the same with its ring encrypted
  (``encrypt=True``: AES-256-GCM records; kind ``aes``) and Gloo (``torch.distributed``), each
  rank a process on its host: the median time of a 4 KiB allreduce, and of a 64 MiB one, whose
  algorithm bandwidth is 64 MiB over that time. "AES / native" is the encrypted ring's 64 MiB
  algorithm bandwidth over the clear ring's, measured on the same hosts in the same run.

A ring allreduce over h hosts moves 2(h-1)/h of the data over each host's link, so its algorithm
bandwidth is at most link x h / (2(h-1)). With ``--shape 1gbit`` every host's link is shaped
(tbf, both ends) and the link is that rate; unshaped, it is the raw stream measured in the same
configuration. "native / limit" is the 64 MiB figure over that limit; "native / duplex limit"
over the same bound with the duplex figure as the link, where the hosts' CPUs, not the link, set
the rate.

    sudo .venv/bin/python benchmarks/multihost.py [--hosts 2,3] [--per-host 1,2] [--shape none,1gbit] \\
        [--cores one,all] [--write benchmarks/RESULTS.md]

``--keras`` measures training instead: a Spark standalone cluster on the simulated hosts
(``tests/standalone.py``), and a Keras 3 fit of ``epoch_time.py``'s CNN through ``sparktrain.run``
with ``DistributedOptimizer``, a fixed batch per rank (``--batch``: 32 and 256; weak scaling), on one host and on
``--hosts`` hosts with ``--per-host`` ranks each: the samples/s of the epochs after the first, and
the ratio to one host's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from common import GlooGroup, machine_line, median_seconds, text_table, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SECTION_BEGIN = "<!-- multihost:begin -->"
SECTION_END = "<!-- multihost:end -->"
SMALL, LARGE = 4096, 64 << 20
PORT = 29400
RATES = {"1gbit": 125e6, "100mbit": 12.5e6}


def worker(kind: str, rank: int, hosts: list[str], small_iters: int, large_iters: int) -> None:
    """One rank: times SMALL and LARGE allreduces of zeros (summed, they stay zeros); rank 0 prints JSON."""
    import numpy as np

    n = len(hosts)
    if kind in ("native", "aes"):
        from sparktrain import engine

        comm = engine.Communicator(rank, n, hosts, [PORT + 1 + r for r in range(n)], b"bench", "bench", timeout=300,
                                   encrypt=kind == "aes")

        def make(nbytes):
            x = np.zeros(nbytes // 4, np.float32)
            return lambda: comm.allreduce_(x, "sum")

        done = comm.close
    else:
        group = GlooGroup(f"tcp://{hosts[0]}:{PORT}", rank, n)
        make, done = group.make, group.close
    out = {}
    for nbytes, iters in ((SMALL, small_iters), (LARGE, large_iters)):
        out[str(nbytes)] = median_seconds(make(nbytes), iters)
    done()
    if rank == 0:
        print("RESULTS " + json.dumps(out), flush=True)


def _receive(conn, nbytes: int) -> float:
    """Receive up to ``nbytes`` from ``conn``; MB/s from the first byte to the last."""
    buf, got, start = bytearray(1 << 20), 0, None
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        start = start or time.perf_counter()
        got += n
    return got / (time.perf_counter() - start) / 1e6


def stream_receiver(ip: str, nbytes: int) -> None:
    import socket

    with socket.create_server((ip, PORT + 100)) as srv:
        print("LISTENING", flush=True)
        conn, _ = srv.accept()
        print("RESULTS " + json.dumps({"mbps": _receive(conn, nbytes)}), flush=True)


def stream_sender(ip: str, nbytes: int) -> None:
    import socket

    block = b"\0" * (1 << 20)
    with socket.create_connection((ip, PORT + 100), timeout=60) as s:
        for _ in range(nbytes // len(block)):
            s.sendall(block)


def stream_duplex(me: str, peer: str, nbytes: int) -> None:
    """Send ``nbytes`` to ``peer`` while receiving as much from it, on one connection each way,
    as a ring's host does: its CPU carries both directions at once. Prints MB/s each way."""
    import socket
    import threading

    srv = socket.create_server((me, PORT + 101))
    print("LISTENING", flush=True)
    got = {}

    def receive():
        conn, _ = srv.accept()
        got["in"] = _receive(conn, nbytes)

    rx = threading.Thread(target=receive)
    rx.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            out = socket.create_connection((peer, PORT + 101), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the peer's listener is not up yet; bounded
    block = b"\0" * (1 << 20)
    start = time.perf_counter()
    for _ in range(nbytes // len(block)):
        out.sendall(block)
    got["out"] = nbytes / (time.perf_counter() - start) / 1e6
    rx.join(120)
    out.close()
    print("RESULTS " + json.dumps(got), flush=True)


def _results(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS "):])
    raise RuntimeError(f"no results (exit {proc.returncode}): {err[-800:]}")


def measure(sim, per_host: int, kinds: list[str], small_iters: int, large_iters: int, repeat: int = 1) -> dict:
    me = [sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    recv = sim.popen(0, [*me, "--stream-receive", sim.ips[0]], env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    line = recv.stdout.readline()
    if "LISTENING" not in line:
        raise RuntimeError(f"the stream receiver did not start: {line!r}")
    send = sim.popen(1, [*me, "--stream-send", sim.ips[0]], env=env)
    send.wait(300)
    figures = {"raw": _results(recv, 60)["mbps"]}
    duplex = [sim.popen(i, [*me, "--stream-duplex", sim.ips[i], sim.ips[1 - i]], env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    ends = [_results(p, 300) for p in duplex]
    figures["duplex"] = min(min(e["in"], e["out"]) for e in ends)
    hosts = [ip for ip in sim.ips for _ in range(per_host)]  # host by host
    for kind in [k for _ in range(repeat) for k in kinds]:  # interleaved: a load that comes and goes hits each
        # One process per host starts that host's ranks, so that they share its /dev/shm (each
        # process simhosts starts has a private one) as a Spark worker's tasks do.
        procs = [sim.popen(i, [*me, "--host-ranks", kind, ",".join(str(i * per_host + k) for k in range(per_host)),
                               ",".join(hosts), str(small_iters), str(large_iters)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(sim.n)]
        try:
            got = _results(procs[0], 600)
            best = figures.get(kind)
            figures[kind] = got if not isinstance(best, dict) else {s: min(best[s], got[s]) for s in got}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            if not isinstance(figures.get(kind), dict):
                figures[kind] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pass
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,3")
    p.add_argument("--per-host", default="1,2")
    p.add_argument("--shape", default="none,1gbit")
    p.add_argument("--kinds", default="native,aes,gloo")
    p.add_argument("--small-iters", type=int, default=300)
    p.add_argument("--large-iters", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each kind this many times, interleaved, keeping each size's best median")
    p.add_argument("--write", metavar="RESULTS_MD")
    p.add_argument("--cores", default="one",
                   help="'one': a core per host (shared when there are more hosts than cores); 'all': every "
                        "host may use every core; or both, 'one,all'")
    p.add_argument("--keras", action="store_true", help="a Keras fit's samples/s across hosts against one host")
    p.add_argument("--epochs", type=int, default=5, help="with --keras: epochs per fit (the first is not timed)")
    p.add_argument("--batch", default="32,256", help="with --keras: samples per rank per step (a list)")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--stream-receive", help=argparse.SUPPRESS)
    p.add_argument("--stream-send", help=argparse.SUPPRESS)
    p.add_argument("--stream-duplex", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--host-ranks", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        kind, rank, hosts, small, large = args.worker
        worker(kind, int(rank), hosts.split(","), int(small), int(large))
        return 0
    if args.stream_receive:
        stream_receiver(args.stream_receive, 512 << 20)
        return 0
    if args.stream_send:
        stream_sender(args.stream_send, 512 << 20)
        return 0
    if args.host_ranks:
        kind, ranks, hosts, small, large = args.host_ranks
        children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind, r, hosts, small,
                                      large]) for r in ranks.split(",")]
        return max(c.wait() for c in children)
    if args.stream_duplex:
        stream_duplex(*args.stream_duplex, 512 << 20)
        return 0

    import simhosts

    reason = simhosts.why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    # Stopped (timeout, kill): the finally blocks below take the simulated hosts down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.keras:
        return keras_scaling(args)
    kinds = args.kinds.split(",")
    rows = []
    for cores, h, per in itertools.product(args.cores.split(","), map(int, args.hosts.split(",")),
                                           map(int, args.per_host.split(","))):
        sim = simhosts.SimHosts(h, share_cores=cores == "all").up()
        try:
            for shape in args.shape.split(","):
                sim.shape_all(shape)
                f = measure(sim, per, kinds, args.small_iters, args.large_iters, args.repeat)
                rows.append(_row(h, per, shape, f, kinds, cores))
                print(text_table(HEADER, rows[-1:]), flush=True)
        finally:
            left = sim.down()
            if left:
                print("left behind: " + "; ".join(left), file=sys.stderr)
    print()
    print(text_table(HEADER, rows))
    if args.write:
        _write(args.write, kinds, rows)
    return 0


def _write(path: str, kinds: list[str], rows: list[list[str]]) -> None:
    machine = machine_line(["torch"]).replace("local mode (no Spark)", "no Spark")
    command = " ".join(["python", "benchmarks/multihost.py", *sys.argv[1:]])
    if "gloo" in kinds:
        write_section(path, SECTION_BEGIN, SECTION_END, "Across simulated hosts", INTRO, machine, command, HEADER, rows)
    else:  # a run without Gloo keeps the section that has it, and writes its own
        write_section(path, "<!-- multihost-aes:begin -->", "<!-- multihost-aes:end -->",
                      "Encrypted ring across simulated hosts", INTRO + AES_NOTE, machine, command, HEADER, rows)


KERAS_BEGIN = "<!-- multihost-keras:begin -->"
KERAS_END = "<!-- multihost-keras:end -->"
KERAS_HEADER = ["hosts", "ranks/host", "ranks", "batch/rank", "samples/s", "vs one host", "ideal"]


def keras_fit(hosts: int, per_host: int, epochs: int, batch: int) -> dict:
    """One fit on a standalone cluster of ``hosts`` simulated hosts with ``per_host`` ranks each."""
    import cloudpickle

    import epoch_time
    from standalone import cluster_session

    import sparktrain

    cloudpickle.register_pickle_by_value(epoch_time)  # the executors need not find benchmarks/
    with cluster_session(hosts, per_host):
        n = hosts * per_host
        return sparktrain.run(epoch_time.train_keras3, args=("cnn", 10, batch * n, epochs, 1e-3, True), num_proc=n,
                              verbose=0, env={"TF_CPP_MIN_LOG_LEVEL": "2"})


def keras_scaling(args) -> int:
    per = int(args.per_host.split(",")[0])
    rows = []
    for batch in map(int, args.batch.split(",")):
        base = None
        for h in sorted({1, *map(int, args.hosts.split(","))}):
            got = keras_fit(h, per, args.epochs, batch)
            n = h * per
            rate = got["steps"] * batch * n / statistics.median(got["epoch_s"][1:])
            base = base or rate / h
            rows.append([str(h), str(per), str(n), str(batch), f"{rate:.0f}", f"{rate / base:.2f}x", f"{h}.00x"])
            print(text_table(KERAS_HEADER, rows[-1:]), flush=True)
    print()
    print(text_table(KERAS_HEADER, rows))
    if args.write:
        machine = machine_line(["tensorflow"], master="spark standalone on simulated hosts")
        command = " ".join(["python", "benchmarks/multihost.py", *sys.argv[1:]])
        write_section(
            args.write, KERAS_BEGIN, KERAS_END, "Keras across simulated hosts",
            "A Keras 3 fit of the digits CNN (epoch_time.py's) through sparktrain.run with DistributedOptimizer, "
            "on a Spark standalone cluster of simulated hosts (one core each), a fixed batch per rank (weak scaling): "
            "samples/s of the epochs after the first (median), against the same fit on one host. Ideal is the "
            "hosts' cores over one host's. Written by `benchmarks/multihost.py --keras`.",
            machine, command, KERAS_HEADER, rows)
    return 0


INTRO = (
    "Allreduce between simulated hosts on one machine (network namespaces on a bridge), ranks numbered host by "
    "host: the native engine in clear and encrypted (AES: AES-256-GCM records on every link, AES / native the "
    "ratio of their 64 MiB figures) and Gloo (torch.distributed), with, in the same configuration, a raw TCP stream from "
    "one host to another (raw) and both hosts sending to each other at once (duplex, the slower direction), "
    "which is what a ring asks of each host. Algorithm bandwidth is 64 MiB over the median time. A ring's most "
    "is link x h / (2(h-1)): the link is the shaped rate, or the raw stream unshaped (native / limit); the "
    "duplex figure in its place gives native / duplex limit. Cores: 1, a core of its own per host; 2/3, three "
    "hosts on two cores; all 2, every host may use both cores of the machine, so the hosts overlap: each host's "
    "ranks count 2 CPUs and spin-wait, and with 2 ranks per host 4 or 6 ranks spin on 2 cores, which the 4 KiB "
    "figures of those rows show. Written by `benchmarks/multihost.py`.")
AES_NOTE = (
    " Here the clear ring (native) and the encrypted one (AES) were measured alternately, --repeat times each, "
    "keeping each one's best median, so that a load on the machine that comes and goes hits both alike.")
HEADER = ["hosts", "cores/host", "ranks/host", "link", "raw MB/s", "duplex MB/s", "4 KiB native us", "4 KiB AES us",
          "4 KiB Gloo us", "64 MiB native MB/s", "64 MiB AES MB/s", "64 MiB Gloo MB/s", "AES / native", "native / Gloo",
          "native / limit", "AES / limit", "native / duplex limit"]


def _row(h: int, per: int, shape: str, f: dict, kinds: list[str], cores: str) -> list[str]:
    def cell(kind, size, scale, fmt):
        v = f.get(kind)
        return fmt.format(scale(v[str(size)])) if isinstance(v, dict) else ("-" if v is None else "failed")

    algbw = {k: LARGE / f[k][str(LARGE)] / 1e6 for k in kinds if isinstance(f.get(k), dict)}
    ring = h / (2 * (h - 1))  # a ring allreduce's algorithm bandwidth over each link's rate
    limit = RATES[shape] / 1e6 * ring if shape in RATES else f["raw"] * ring
    duplex_limit = min(limit, f["duplex"] * ring)
    shared = "1" if h <= os.cpu_count() else f"{os.cpu_count()}/{h}"
    return [str(h), shared if cores == "one" else f"all {os.cpu_count()}", str(per), shape, f"{f['raw']:.0f}",
            f"{f['duplex']:.0f}",
            cell("native", SMALL, lambda t: t * 1e6, "{:.0f}"), cell("aes", SMALL, lambda t: t * 1e6, "{:.0f}"),
            cell("gloo", SMALL, lambda t: t * 1e6, "{:.0f}"),
            *(f"{algbw[k]:.0f}" if k in algbw else ("failed" if k in f else "-") for k in ("native", "aes", "gloo")),
            f"{algbw['aes'] / algbw['native']:.2f}" if {"native", "aes"} <= set(algbw) else "-",
            f"{algbw['native'] / algbw['gloo']:.2f}x" if {"native", "gloo"} <= set(algbw) else "-",
            f"{algbw['native'] / limit:.2f}" if "native" in algbw else "-",
            f"{algbw['aes'] / limit:.2f}" if "aes" in algbw else "-",
            f"{algbw['native'] / duplex_limit:.2f}" if "native" in algbw else "-"]


if __name__ == "__main__":
    sys.exit(main())
