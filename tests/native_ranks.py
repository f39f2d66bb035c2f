"""Ranks of the native engine as plain forked processes, for tests/test_native_*.py: no Spark."""
from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import traceback
import uuid

import numpy as np

from sparktrain import native

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((LOOPBACK, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def small_ints(size: int, rank: int, dtype: str):
    """Integers in -5..5: every sum and quotient below is exact in every dtype, in any order."""
    return (((np.arange(size, dtype=np.int64) * 7 + rank * 3) % 11) - 5).astype(np_dtype(dtype))


def expected(size: int, n: int, dtype: str, op: str):
    total = sum(small_ints(size, r, "int64") for r in range(n)) if n else np.zeros(size, np.int64)
    if op == "sum":
        return total.astype(np_dtype(dtype))
    if dtype.startswith("int"):
        return (np.sign(total) * (np.abs(total) // n)).astype(dtype)  # truncation toward zero
    if dtype in ("float16", "bfloat16"):
        return (total.astype(np.float32) / np.float32(n)).astype(np_dtype(dtype))
    return (total.astype(dtype) / np.array(n, dtype)).astype(dtype)


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()[:16]


SECRET = b"test-secret"


def _rank_main(rank, n, hosts, ports, name, tcp, timeout, fn, args, queue, listeners):
    try:
        comm = native.Communicator(rank, n, hosts, ports, SECRET, name, timeout=timeout, force_tcp=tcp,
                                   listener=listeners.get(rank))
        try:
            result = fn(comm, *args)
        finally:
            comm.close()
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(n: int, fn, *args, tcp: bool = False, hosts=None, timeout: float = 60.0, name: str | None = None,
              on_start=None, wait: float = 120.0, listeners=None, heartbeat=None):
    """Run ``fn(comm, *args)`` on ``n`` forked ranks; {rank: ("ok", value) or ("error", text)}.

    ``on_start(processes)`` runs once they are started (to kill one, say). Ranks that never
    report (killed ones) are missing from the answer.
    """
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    hosts = hosts or [LOOPBACK] * n
    ports = free_ports(n)
    listeners = listeners or {}
    for r, sock in listeners.items():
        ports[r] = sock.getsockname()[1]
    name = name or f"test-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_rank_main, args=(r, n, hosts, ports, name, tcp, timeout, fn, args, queue, listeners))
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        if on_start is not None:
            on_start(procs)
        results = {}
        deadline = time.monotonic() + wait
        while True:
            # Wait for a report, or for a rank that has not reported to die: whichever comes first.
            pending = [p for r, p in enumerate(procs) if r not in results and p.exitcode in (None, 0)]
            if not pending or time.monotonic() > deadline:
                break
            ready = multiprocessing.connection.wait([queue._reader] + [p.sentinel for p in pending],
                                                    timeout=deadline - time.monotonic())
            if queue._reader in ready:
                rank, status, value = queue.get()
                results[rank] = (status, value)
        return results
    finally:
        for p in procs:
            p.join(timeout=wait)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join()


def all_ok(results: dict, n: int) -> dict:
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors, errors
    assert sorted(results) == list(range(n)), results
    return {r: v for r, (_, v) in results.items()}


# -- what the ranks run ------------------------------------------------------------------------

def correctness(comm, sizes, dtypes=DTYPES):
    """Every op and dtype at each size; returns failures and a digest per case."""
    n, r = comm.size, comm.rank
    bad, digests = [], {}
    for dtype in dtypes:
        for op in ("sum", "average"):
            for size in sizes:
                got = comm.allreduce(small_ints(size, r, dtype), op)
                want = expected(size, n, dtype, op)
                if got.dtype != want.dtype or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                    first = int(np.argmax(got != want)) if got.shape == want.shape else -1
                    bad.append(f"{op} {dtype}[{size}]: element {first}: got {got[first] if first >= 0 else got.shape}, "
                               f"want {want[first] if first >= 0 else want.shape}")
                digests[f"{op}-{dtype}-{size}"] = digest(got)
    rng = np.random.default_rng(r)
    for dtype in ("float32", "float16", "bfloat16"):
        digests[f"random-{dtype}"] = digest(comm.allreduce(rng.standard_normal(100_003).astype(np_dtype(dtype)),
                                                           "average"))
    return {"bad": bad, "digests": digests}


def other_ops(comm):
    n, r = comm.size, comm.rank
    out = {}
    for root in range(n):
        out[f"bcast{root}"] = comm.broadcast(np.full((3, 5), r * 10 + 1, np.float64), root=root).tolist()
        out[f"bcast_big{root}"] = digest(comm.broadcast(np.arange(3_000_001, dtype=np.int32) * (r + 1), root=root))
    out["gather"] = comm.allgather(np.full((r + 1, 2), r, np.int32)).tolist()
    out["gather_empty"] = comm.allgather(np.zeros((0 if r % 2 else 2, 3), np.float32)).shape
    out["gather_big"] = digest(comm.allgather(np.arange(1_000_003 + r, dtype=np.float32) + r))
    comm.barrier()
    return out


def listening_sockets(comm):
    import psutil

    return [c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def segment_left(comm, name):
    return os.path.exists("/dev/shm" + native.segment_name(name, comm.node))


def allreduce_forever(comm, victim, started):
    """Allreduce until a collective fails; the victim sets ``started`` once inside the loop."""
    x = np.ones(1 << 18, np.float32)
    i = 0
    while True:
        if comm.rank == victim and i == 3:
            started.set()
        comm.allreduce_(x, "sum")
        x[:] = 1
        i += 1


def mismatched(comm):
    return comm.allreduce(np.ones(10 + comm.rank, np.float32), "sum")


def one_rank_never_comes(comm, late, arrived):
    """Every rank but ``late`` allreduces; ``late`` waits until they have all failed, then returns."""
    if comm.rank == late:
        arrived.wait()
        return "never called"
    try:
        comm.allreduce(np.ones(5, np.float32), "sum")
    finally:
        arrived.wait()


def gather_mismatched_shapes(comm):
    return comm.allgather(np.zeros((2, 3 + comm.rank), np.float32))
