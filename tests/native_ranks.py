"""Ranks of the native engine as plain processes, for tests/test_native_*.py: no Spark.

They start from a fork server (:data:`CONTEXT`), not as forks of the test process: that process has
threads (xdist's, OpenBLAS's, a test's proxy), and a fork of a threaded process may deadlock in the
child (Python 3.12+ warns of it at every fork)."""
from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
import uuid

import cloudpickle
import numpy as np

from sparktrain import engine

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    from sparktrain.executor.rendezvous import reserve_port

    socks = [reserve_port(LOOPBACK) for _ in range(n)]  # where the ranks' ports come from, and why
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
#: Where the ranks start: one server per test process, started at its first run_ranks, forks each
#: rank. Their functions travel by cloudpickle (lambdas and a test's local functions too); their
#: other arguments by multiprocessing (sockets, and this context's Events and Barriers, which a test
#: makes with ``CONTEXT.Event()``); the environment is the test process's at the call, as a fork's.
CONTEXT = multiprocessing.get_context("forkserver")
#: The server imports this module (numpy and the engine's Python) once, so that each rank starts
#: as quickly as a fork did; with one BLAS thread, so that importing numpy starts no thread there.
_SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _start_server() -> None:
    from multiprocessing import forkserver

    CONTEXT.set_forkserver_preload([__name__])
    # Python 3.11's server is handed sys.path but does not use it: it finds this module by PYTHONPATH.
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**_SERVER_ENV, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(rank, n, hosts, ports, name, tcp, timeout, pickled_fn, args, queue, listeners, spin, encrypt, environ):
    os.environ.clear()
    os.environ.update(environ)
    try:
        fn = cloudpickle.loads(pickled_fn)
        comm = engine.Communicator(rank, n, hosts, ports, SECRET, name, timeout=timeout, force_tcp=tcp,
                                   listener=listeners.get(rank), spin=spin, encrypt=encrypt)
        try:
            result = fn(comm, *args)
        finally:
            comm.close()
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(n: int, fn, *args, tcp: bool = False, hosts=None, timeout: float = 60.0, name: str | None = None,
              on_start=None, wait: float = 120.0, listeners=None, heartbeat=None, spin: float | None = None,
              encrypt: bool = False, dial=None):
    """Run ``fn(comm, *args)`` on ``n`` ranks; {rank: ("ok", value) or ("error", text)}.

    ``encrypt``: the ring in AES-256-GCM records. ``dial``: {rank: {peer: port}}, where that rank
    connects to reach that peer instead of the peer's own port (a proxy between them).

    ``on_start(processes)`` runs once they are started (to kill one, say). Ranks that never
    report (killed ones) are missing from the answer.
    """
    _start_server()
    ctx = CONTEXT
    queue = ctx.Queue()
    hosts = hosts or [LOOPBACK] * n
    ports = free_ports(n)
    listeners = listeners or {}
    for r, sock in listeners.items():
        ports[r] = sock.getsockname()[1]
    name = name or f"test-{uuid.uuid4().hex[:8]}"
    dial = dial or {}
    procs = [ctx.Process(target=_rank_main, args=(r, n, hosts, [dial.get(r, {}).get(k, p) for k, p in enumerate(ports)],
                                                  name, tcp, timeout, cloudpickle.dumps(fn), args, queue, listeners,
                                                  spin, encrypt, dict(os.environ)))
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


def own_connections(kind: str = "inet") -> list:
    """This rank's sockets, less those it inherited from the test process that forked it (a test
    module run earlier in the same session may have left that process holding a connection)."""
    import psutil

    def key(c):
        return c.family, c.type, c.laddr, c.raddr, c.status

    inherited = {key(c) for c in psutil.Process(os.getppid()).net_connections(kind=kind)}
    return [c for c in psutil.Process().net_connections(kind=kind) if key(c) not in inherited]


def listening_sockets(comm):
    import psutil

    return [c.laddr for c in own_connections("tcp") if c.status == psutil.CONN_LISTEN]


def segment_left(comm, name):
    return os.path.exists("/dev/shm" + engine.segment_name(name, comm.node))


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


def allreduce_until_it_fails(comm, victim, started, size=1 << 18):
    """As allreduce_forever, but the failure is the result: its code and message (without this
    rank's prefix), how long the failing call took, and what sockets the rank holds once it has
    closed the communicator."""
    import psutil

    x = np.ones(size, np.float32)
    i = 0
    while True:
        if comm.rank == victim and i == 3:
            started.set()
        t0 = time.monotonic()
        try:
            comm.allreduce_(x, "sum")
        except engine.CollectiveError as e:
            took = time.monotonic() - t0
            text = str(e)
            prefix = f"rank {comm.rank}: "
            comm.close()
            return {"code": e.code, "message": text[len(prefix):] if text.startswith(prefix) else text,
                    "took": took, "sockets": [c.laddr for c in own_connections()]}
        x[:] = 1
        i += 1


def one_rank_leaves_early(comm, early):
    """Every rank allreduces once; all but ``early`` then allreduce again, which must fail."""
    comm.allreduce(np.ones(5, np.float32), "sum")
    if comm.rank == early:
        comm.close()
        return "left"
    try:
        comm.allreduce(np.ones(5, np.float32), "sum")
    except engine.CollectiveError as e:
        return {"code": e.code, "message": str(e)}
    return "no error"


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


# -- every op and dtype, reducescatter, alltoall, disagreements ----------------------------------

ALL_DTYPES = engine.DTYPES
UNSIGNED = ("uint8", "uint16")


def op_inputs(size: int, rank: int, dtype: str, op: str):
    """Values whose reduction is exact in every dtype, in any order: small, and tiny for products."""
    i = np.arange(size, dtype=np.int64) * 7 + rank * 3
    if dtype == "bool":
        return (i % 5) < 2
    if op == "product":
        v = i % 4 if dtype in UNSIGNED else (i % 5) - 2
    else:
        v = i % 11 if dtype in UNSIGNED else (i % 11) - 5
    return v.astype(np_dtype(dtype))


def op_expected(arrays: list, dtype: str, op: str):
    """What numpy says, element-wise over ``arrays`` in rank order, in the dtype (integers wrap)."""
    import functools

    dt = np_dtype(dtype)
    if dtype == "bool":
        fn = np.logical_or if op in ("sum", "max") else np.logical_and
        return functools.reduce(fn, arrays).astype(bool)
    if op == "average":
        total = functools.reduce(np.add, [a.astype(np.int64) for a in arrays])
        n = len(arrays)
        if dt.kind in "iu":
            return (np.sign(total) * (np.abs(total) // n)).astype(dt)  # truncation toward zero
        if dtype in ("float16", "bfloat16"):
            return (total.astype(np.float32) / np.float32(n)).astype(dt)
        return (total.astype(dt) / np.array(n, dt)).astype(dt)
    fn = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    if dt.kind == "f" or dtype == "bfloat16":  # exact in float64 for these inputs; rounded once
        return functools.reduce(fn, [a.astype(np.float64) for a in arrays]).astype(dt)
    with np.errstate(over="ignore"):
        return functools.reduce(fn, arrays).astype(dt)


def _compare(bad: list, label: str, got, want) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        bad.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)):  # bit for bit
        differs = (got.reshape(-1).view(np.uint8).reshape(got.size, -1) !=
                   want.reshape(-1).view(np.uint8).reshape(want.size, -1)).any(axis=1)
        first = int(np.flatnonzero(differs)[0])
        bad.append(f"{label}: element {first}: got {got.reshape(-1)[first]}, want {want.reshape(-1)[first]}")


def every_op(comm, sizes, dtypes=ALL_DTYPES):
    """Every op of every dtype at each size, against numpy; integer sums and products that wrap."""
    n, r = comm.size, comm.rank
    bad, digests = [], {}
    for dtype in dtypes:
        for op in engine.OPS:
            if dtype == "bool" and op == "average":
                continue
            for size in sizes:
                got = comm.allreduce(op_inputs(size, r, dtype, op), op)
                want = op_expected([op_inputs(size, k, dtype, op) for k in range(n)], dtype, op)
                _compare(bad, f"{op} {dtype}[{size}]", got, want)
                digests[f"{op}-{dtype}-{size}"] = digest(got)
        dt = np_dtype(dtype)
        if dt.kind in "iu":  # wrapping: the largest value summed, 100 + rank multiplied
            big = [np.full(5, np.iinfo(dt).max - k, dt) for k in range(n)]
            _compare(bad, f"sum wraps {dtype}", comm.allreduce(big[r], "sum"), op_expected(big, dtype, "sum"))
            prod = [np.full(5, 100 + k, dt) for k in range(n)]
            _compare(bad, f"product wraps {dtype}", comm.allreduce(prod[r], "product"),
                     op_expected(prod, dtype, "product"))
    # In place, and shaped: the shape travels with the call, the result keeps it.
    x = op_inputs(12, r, "float32", "max").reshape(3, 4)
    comm.allreduce_(x, "max")
    _compare(bad, "allreduce_ max float32[3,4]", x,
             op_expected([op_inputs(12, k, "float32", "max").reshape(3, 4) for k in range(n)], "float32", "max"))
    rng = np.random.default_rng(r)
    for op in ("min", "max", "product"):
        digests[f"random-{op}"] = digest(comm.allreduce(rng.standard_normal(50_003).astype(np.float16), op))
    return {"bad": bad, "digests": digests}


def reducescatter_cases(comm):
    """Reducescatter against numpy: rows the ranks do not divide, fewer rows than ranks, no rows."""
    n, r = comm.size, comm.rank
    bad = []
    for rows in sorted({0, 1, max(0, n - 1), n, 7, 2 * n + 1}):
        for trailing in ((), (3,)):
            for dtype, op in (("float32", "sum"), ("int32", "average"), ("int16", "max"), ("float16", "min"),
                              ("bool", "sum")):
                def make(k, rows=rows, trailing=trailing, dtype=dtype, op=op):
                    size = rows * int(np.prod(trailing, dtype=np.int64))
                    return op_inputs(size, k, dtype, op).reshape((rows,) + trailing)

                got = comm.reducescatter(make(r), op)
                full = op_expected([make(k) for k in range(n)], dtype, op)
                lo = sum(engine.split_rows(rows, n)[:r])
                _compare(bad, f"reducescatter {op} {dtype}{(rows,) + trailing}", got,
                         full[lo:lo + engine.split_rows(rows, n)[r]])
    try:  # a scalar has no rows: refused on every rank together, and the communicator goes on
        comm.reducescatter(np.float32(r), "sum")
        bad.append("reducescatter of a scalar: no error")
    except engine.CollectiveError as e:
        if "scalar" not in str(e):
            bad.append(f"reducescatter of a scalar: {e}")
    # Over the 256 KiB shared-memory chunk: two large chunks; a large one and then a small one.
    for big in (40_003, 22_700):
        got = comm.reducescatter(np.arange(big * 3, dtype=np.float32).reshape(big, 3) * (r + 1), "average")
        full = np.arange(big * 3, dtype=np.float32).reshape(big, 3) * np.float32(n * (n + 1) // 2) / np.float32(n)
        lo = sum(engine.split_rows(big, n)[:r])
        _compare(bad, f"reducescatter big {big}", got, full[lo:lo + engine.split_rows(big, n)[r]])
    return bad


def _a2a_send(rank: int, n: int, case: str):
    """What ``rank`` sends in ``case``: (array, splits or None)."""
    if case == "even":
        return np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) + 100 * rank, None
    if case == "ragged":
        splits = [(rank + j) % 3 for j in range(n)]
    elif case == "empty_send":  # rank 0 sends nothing at all
        splits = [0 if rank == 0 else j + 1 for j in range(n)]
    elif case == "empty_receive":  # nobody sends to the last rank
        splits = [0 if j == n - 1 else rank + 1 for j in range(n)]
    elif case == "no_rows":
        splits = [0] * n
    elif case == "big":  # over the shared-memory chunk
        splits = [20_000 + 7 * j + rank for j in range(n)]
    else:
        raise ValueError(case)
    rows = sum(splits)
    dtype = np.int16 if case == "ragged" else np.float64
    return (np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) + 1000 * rank).astype(dtype), splits


A2A_CASES = ("even", "ragged", "empty_send", "empty_receive", "no_rows", "big")


def alltoall_cases(comm):
    """Alltoall against what every rank sent, computed here from the same rule."""
    n, r = comm.size, comm.rank
    bad = []
    for case in A2A_CASES:
        got, got_splits = comm.alltoall(*_a2a_send(r, n, case))
        parts, want_splits = [], []
        for k in range(n):
            a, splits = _a2a_send(k, n, case)
            splits = splits or [a.shape[0] // n] * n
            lo = sum(splits[:r])
            parts.append(a[lo:lo + splits[r]])
            want_splits.append(splits[r])
        _compare(bad, f"alltoall {case}", got, np.concatenate(parts))
        if list(got_splits) != want_splits:
            bad.append(f"alltoall {case}: received splits {list(got_splits)}, want {want_splits}")
    return bad


def _received(comm, call) -> int:
    before = comm.traffic()[1]
    call()
    return comm.traffic()[1] - before


def ring_traffic(comm):
    """The bytes this rank received over the ring for an allgather and an alltoall, beyond what the
    same calls with no rows receive (their shapes and the agreement before them)."""
    n, r = comm.size, comm.rank
    splits = [37 * (r + 1) + 11 * j for j in range(n)]
    gather = _received(comm, lambda: comm.allgather(np.ones((1000 + 100 * r, 3)))) - \
        _received(comm, lambda: comm.allgather(np.zeros((0, 3))))
    a2a = _received(comm, lambda: comm.alltoall(np.ones((sum(splits), 3)), splits)) - \
        _received(comm, lambda: comm.alltoall(np.zeros((0, 3)), [0] * n))
    return {"node": comm.node, "leader": comm.local_rank == 0, "splits": splits, "gather": gather, "a2a": a2a}


def _expect_mismatch(comm, label: str, call, out: dict) -> None:
    """Run ``call``; record the MISMATCH message (without this rank's prefix), then whether the
    communicator still sums right."""
    try:
        call()
        out[label] = "no error"
    except engine.CollectiveError as e:
        text = str(e)
        prefix = f"rank {comm.rank}: "
        out[label] = (e.code, text[len(prefix):] if text.startswith(prefix) else text)
    after = comm.allreduce(np.ones(3, np.float32), "sum")
    out[label + " then"] = after.tolist()


def disagreements(comm, deviants):
    """Each kind of disagreement, made by the ranks in ``deviants``; every rank should get the same
    MISMATCH, and the allreduce after each should still be right."""
    odd = comm.rank in deviants
    out: dict = {}
    f32 = np.float32
    _expect_mismatch(comm, "shape", lambda: comm.allreduce(np.ones(5 if odd else (3, 4), f32), "sum"), out)
    _expect_mismatch(comm, "dtype", lambda: comm.allreduce(np.ones(4, np.int32 if odd else f32), "sum"), out)
    _expect_mismatch(comm, "op", lambda: comm.allreduce(np.ones(4, f32), "max" if odd else "sum"), out)
    _expect_mismatch(comm, "root", lambda: comm.broadcast(np.ones(4, f32), root=1 if odd else 0), out)
    _expect_mismatch(comm, "kind", lambda: (comm.broadcast(np.ones(4, f32)) if odd else
                                           comm.allreduce(np.ones(4, f32), "sum")), out)
    _expect_mismatch(comm, "big shape", lambda: comm.allreduce(np.ones(200_000 + odd, f32), "sum"), out)
    _expect_mismatch(comm, "many dims", lambda: comm.allreduce(np.ones((1,) * 9 + (2 + odd,), f32), "sum"), out)
    _expect_mismatch(comm, "reducescatter", lambda: comm.reducescatter(np.ones((4, 2 + odd), f32), "sum"), out)
    _expect_mismatch(comm, "allgather", lambda: comm.allgather(np.ones((2, 3 + odd), f32)), out)
    _expect_mismatch(comm, "alltoall splits", lambda: comm.alltoall(np.ones((comm.size, 2), f32),
                                                                     [2] + [1] * (comm.size - 1) if odd else None), out)
    _expect_mismatch(comm, "alltoall dtype", lambda: comm.alltoall(np.ones((comm.size, 2), np.int64 if odd else f32)),
                     out)
    _expect_mismatch(comm, "barrier", lambda: comm.barrier() if odd else comm.allreduce(np.ones(1, f32), "sum"), out)
    return out


# -- the pipelined allreduce across hosts -------------------------------------------------------

PIPELINED_BYTES = 6_000_017  # over native/pipeline.c's PIPE_MIN_BYTES (4 MiB); in elements, no host count divides


def engine_order_sum(arrays: list, nodes: list[int], dtype: str):
    """The sum the engine computes across hosts, in its order: each host's ranks in rank order (half
    types in float, rounded once), then round the ring, host j's part of the buffer (its j-th m-th)
    starting from host j's sum, each next host adding its own. Floats are exact to that order."""
    dt = np_dtype(dtype)
    work = np.float32 if dt.itemsize == 2 else dt
    m = max(nodes) + 1
    sums = []
    for h in range(m):
        acc = None
        for r, a in enumerate(arrays):
            if nodes[r] == h:
                acc = a.astype(work) if acc is None else acc + a.astype(work)
        sums.append(acc.astype(dt))
    size, out = arrays[0].size, np.empty(arrays[0].size, dt)
    for j in range(m):
        lo, hi = size * j // m, size * (j + 1) // m
        acc = sums[j][lo:hi]
        for t in range(1, m):
            acc = (sums[(j + t) % m][lo:hi].astype(work) + acc.astype(work)).astype(dt)
        out[lo:hi] = acc
    return out


PIPELINED_CASES = (("float32", "sum"), ("float64", "min"), ("int32", "average"), ("float16", "max"),
                   ("bfloat16", "product"), ("int64", "sum"))


def pipelined(comm, cases=PIPELINED_CASES, randoms=("float32", "float16"), nbytes=PIPELINED_BYTES):
    """Allreduces over the pipelining threshold, uneven sizes, against numpy: ops of several dtypes
    on values exact in any order, random floats summed in the engine's order (bit for bit, so the
    pipelined path reduces every element as the whole-buffer ring does), a reducescatter."""
    n, r = comm.size, comm.rank
    nodes = comm.allgather(np.array([comm.node], np.int64)).tolist()
    bad, digests = [], {}
    for dtype, op in cases:
        size = nbytes // np_dtype(dtype).itemsize
        got = comm.allreduce(op_inputs(size, r, dtype, op), op)
        _compare(bad, f"{op} {dtype}[{size}]", got, op_expected([op_inputs(size, k, dtype, op) for k in range(n)],
                                                                dtype, op))
        digests[f"{op}-{dtype}"] = digest(got)
    for dtype in randoms:
        size = nbytes // np_dtype(dtype).itemsize
        rngs = [np.random.default_rng(1000 + k) for k in range(n)]
        arrays = [g.standard_normal(size, np.float32).astype(np_dtype(dtype)) for g in rngs]
        got = comm.allreduce(arrays[r], "sum")
        _compare(bad, f"random sum {dtype}[{size}]", got, engine_order_sum(arrays, nodes, dtype))
        digests[f"random-{dtype}"] = digest(got)
    rows = nbytes // 12
    full = [op_inputs(rows * 3, k, "float32", "average").reshape(rows, 3) for k in range(n)]
    got = comm.reducescatter(full[r], "average")
    lo = sum(engine.split_rows(rows, n)[:r])
    _compare(bad, f"reducescatter average float32[{rows},3]", got,
             op_expected(full, "float32", "average")[lo:lo + engine.split_rows(rows, n)[r]])
    return {"bad": bad, "digests": digests}
