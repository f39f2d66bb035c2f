"""The native CPU collective engine (``native/``), seen from Python.

The engine is a small C library built into the package (``sparktrain/_collective*.so``) and
loaded with ctypes, which releases the GIL for every call. Within a host the ranks meet in
shared memory; between hosts, one leader per host joins a TCP ring. This module owns the
policy the library leaves to its caller: the topology, the deadline, and the ring's
connections, each of which must prove it holds the run's secret before the library sees it.
:meth:`Communicator.make_current` publishes a communicator to code in the process that holds no
handle: sparktrain's TensorFlow kernels (``sparktrain.tensorflow.kernels``), which link against
this same library and call it without Python.

Pure of Spark and TensorFlow: it needs numpy only, so tests run ranks as plain processes::

    comm = Communicator(rank=r, size=3, hosts=["h"] * 3, ports=[p0, p1, p2], secret=key, name=run)
    total = comm.allreduce(np.arange(4.0), op="sum")
    mine = comm.reducescatter(np.ones((7, 2), np.float32), op="max")   # rows 3, 2 and 2
    got, got_splits = comm.alltoall(np.arange(6), splits=[1, 2, 3])
    comm.close()

Ranks that pass different shapes, dtypes, ops or roots, or call different collectives, all get
the same :class:`CollectiveError` (code :data:`MISMATCH`), and the communicator goes on working;
a dead peer or a timeout (:data:`PEER`, :data:`TIMEOUT`) ends it (:data:`BROKEN` after).
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import importlib.machinery
import json
import os
import secrets
import socket
import struct
import threading
import time
from typing import Sequence

from . import settings, worker_env
from .errors import SparkTrainError

#: ``SPARKTRAIN_NATIVE_LIBRARY``: load the engine from this path instead (a sanitizer build, say).
LIBRARY_ENV = "SPARKTRAIN_NATIVE_LIBRARY"
#: The file holding the run's collective key; ``run`` writes it into the rank's work directory.
KEY_FILE_ENV = worker_env.COLLECTIVE_KEY_FILE

_ABI_VERSION = 4
_ERRLEN = 1024
_HELLO = b"STC1"

#: The reductions, by the names every reducing call takes (``op=``); codes of ``enum stc_op``.
OPS = ("sum", "average", "min", "max", "product")
#: The dtypes the engine reduces (numpy names; bfloat16 is ml_dtypes'); codes of ``enum stc_dtype``.
#: Broadcast, allgather and alltoall also move any other fixed-size dtype, as opaque bytes.
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8", "int16", "uint16", "bool")
_OP_CODES = {name: code for code, name in enumerate(OPS)}
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
_OPAQUE, _OPAQUE_MAX = 256, 1024  # STC_OPAQUE + itemsize: moved, never reduced
_MAX_DIMS = 64  # numpy's limit


#: The library's return codes (``native/collective.h``), by name.
TIMEOUT, PEER, MISMATCH, BROKEN = -2, -3, -4, -6


class CollectiveError(SparkTrainError):
    """A native collective failed: a peer died, ranks disagreed, or a wait passed its deadline.

    ``code`` is the library's return code (:data:`TIMEOUT`, :data:`PEER`, :data:`MISMATCH`,
    :data:`BROKEN`, ...), or :data:`MISMATCH` for disagreements found in Python.
    """

    def __init__(self, message: str, code: int = MISMATCH):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return type(self), (str(self), self.code)


class _Config(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int), ("size", ctypes.c_int),
        ("local_rank", ctypes.c_int), ("local_size", ctypes.c_int),
        ("node", ctypes.c_int), ("num_nodes", ctypes.c_int),
        ("shm_name", ctypes.c_char_p),
        ("chunk_bytes", ctypes.c_size_t),
        ("timeout_s", ctypes.c_double), ("heartbeat_s", ctypes.c_double),
        ("next_fd", ctypes.c_int), ("prev_fd", ctypes.c_int),
        ("rank_node", ctypes.POINTER(ctypes.c_int32)), ("rank_local", ctypes.POINTER(ctypes.c_int32)),
        ("spin_s", ctypes.c_double),
    ]


_lib = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _library_path() -> str | None:
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_collective" + suffix)
        if os.path.exists(path):
            return path
    return None


def library():
    """The loaded engine (a ``ctypes.CDLL``), or None when it was not built or does not load."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None or _lib_error is not None:
            return _lib
        path = _library_path()
        if path is None:
            _lib_error = ("sparktrain's native collective engine was not built (no sparktrain/_collective*.so); "
                          "reinstall sparktrain where gcc is available: pip install -e . or pip install sparktrain")
            return None
        try:
            lib = ctypes.CDLL(path)
            if lib.stc_abi_version() != _ABI_VERSION:
                raise OSError(f"ABI version {lib.stc_abi_version()}, expected {_ABI_VERSION}")
        except (OSError, AttributeError) as e:
            _lib_error = f"sparktrain's native collective engine at {path} does not load: {e}"
            return None
        err = ctypes.c_char_p
        lib.stc_create.argtypes = [ctypes.POINTER(_Config), ctypes.POINTER(ctypes.c_void_p), err, ctypes.c_size_t]
        lib.stc_destroy.argtypes = [ctypes.c_void_p]
        lib.stc_destroy.restype = None
        i64p, vp, i = ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_int
        lib.stc_allreduce.argtypes = [vp, vp, i, i, i, i64p, err, ctypes.c_size_t]
        lib.stc_reducescatter.argtypes = [vp, vp, vp, i, i, i, i64p, err, ctypes.c_size_t]
        lib.stc_broadcast.argtypes = [vp, vp, i, i, i64p, i, err, ctypes.c_size_t]
        lib.stc_allgatherv.argtypes = [vp, vp, vp, ctypes.POINTER(ctypes.c_uint64), i, i, i64p, err,
                                       ctypes.c_size_t]
        lib.stc_alltoallv.argtypes = [vp, vp, vp, ctypes.POINTER(ctypes.c_uint64), i, i, i64p, err,
                                      ctypes.c_size_t]
        lib.stc_barrier.argtypes = [ctypes.c_void_p, err, ctypes.c_size_t]
        lib.stc_comm_rank.argtypes = [ctypes.c_void_p]
        lib.stc_comm_size.argtypes = [ctypes.c_void_p]
        lib.stc_set_current.argtypes = [ctypes.c_void_p]
        lib.stc_set_current.restype = None
        lib.stc_current_acquire.argtypes = []
        lib.stc_current_acquire.restype = ctypes.c_void_p
        lib.stc_current_release.argtypes = []
        lib.stc_current_release.restype = None
        _lib = lib
        return _lib


def unavailable_reason() -> str | None:
    """Why the engine cannot be used here, or None when it can."""
    library()
    return _lib_error


def available() -> bool:
    return library() is not None


# -- topology ----------------------------------------------------------------------------------

def layout(hosts: Sequence[str], force_tcp: bool = False) -> tuple[list[int], list[int]]:
    """Each rank's host index (in order of first appearance) and local rank.

    With ``force_tcp`` every rank is a host of its own, so ranks on one machine use the ring.

    >>> layout(["a", "b", "a"])
    ([0, 1, 0], [0, 0, 1])
    """
    if force_tcp:
        return list(range(len(hosts))), [0] * len(hosts)
    index: dict[str, int] = {}
    nodes, locals_ = [], []
    counts: dict[str, int] = {}
    for h in hosts:
        nodes.append(index.setdefault(h, len(index)))
        locals_.append(counts.get(h, 0))
        counts[h] = counts.get(h, 0) + 1
    return nodes, locals_


def segment_name(name: str, node: int) -> str:
    """The shared-memory segment of run ``name`` on host ``node`` (``/dev/shm`` + this, on Linux)."""
    return f"/sparktrain-{hashlib.sha256(name.encode()).hexdigest()[:16]}-h{node}"


# -- the ring's connections --------------------------------------------------------------------

def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return data


def _authenticate_client(sock: socket.socket, key: bytes, name: bytes, rank: int) -> None:
    hello = _recv_exact(sock, len(_HELLO) + 32)
    if hello[:len(_HELLO)] != _HELLO:
        raise ConnectionError("the peer is not a sparktrain collective endpoint")
    nonce_s, nonce_c = hello[len(_HELLO):], secrets.token_bytes(32)
    r = struct.pack("!i", rank)
    sock.sendall(r + nonce_c + _mac(key, b"client", name, nonce_s, nonce_c, r))
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"server", name, nonce_s, nonce_c, r)):
        raise ConnectionError("the peer does not hold the run's secret")


def _authenticate_server(sock: socket.socket, key: bytes, name: bytes, expected_rank: int) -> None:
    nonce_s = secrets.token_bytes(32)
    sock.sendall(_HELLO + nonce_s)
    reply = _recv_exact(sock, 4 + 32 + 32)
    r, nonce_c, mac = reply[:4], reply[4:36], reply[36:]
    if not hmac.compare_digest(mac, _mac(key, b"client", name, nonce_s, nonce_c, r)):
        raise ConnectionError("refused a connection that does not hold the run's secret")
    if struct.unpack("!i", r)[0] != expected_rank:
        raise ConnectionError(f"rank {struct.unpack('!i', r)[0]} connected where rank {expected_rank} was expected")
    sock.sendall(_mac(key, b"server", name, nonce_s, nonce_c, r))


def _connect_ring(listener: socket.socket, next_addr: tuple[str, int], key: bytes, name: bytes, rank: int,
                  next_rank: int, prev_rank: int, deadline: float) -> tuple[socket.socket, socket.socket]:
    """Connect to the next leader and accept the previous one, both authenticated."""
    out: dict[str, object] = {}

    def dial():
        delay = 0.01
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.connect(next_addr)
                _authenticate_client(s, key, name, rank)
                s.settimeout(None)
                out["next"] = s
                return
            except (OSError, ConnectionError) as e:
                s.close()
                if time.monotonic() + delay > deadline:
                    out["error"] = f"rank {rank} could not connect to rank {next_rank} at {next_addr[0]}:{next_addr[1]}: {e}"
                    return
                time.sleep(delay)  # the peer is not listening yet: nothing to wait on but time
                delay = min(delay * 2, 0.5)

    dialer = threading.Thread(target=dial, name="sparktrain-ring-dial", daemon=True)
    dialer.start()
    prev = None
    try:
        while prev is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveError(f"rank {rank} waited for rank {prev_rank} to connect until the collective "
                                      f"timeout passed")
            listener.settimeout(left)
            try:
                s, _ = listener.accept()
            except socket.timeout:
                continue
            s.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))  # a silent stranger cannot stall us long
            try:
                _authenticate_server(s, key, name, prev_rank)
                s.settimeout(None)
                prev = s
            except (OSError, ConnectionError):
                s.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if "next" not in out:
            raise CollectiveError(str(out.get("error", f"rank {rank} timed out connecting to rank {next_rank}")))
        return out["next"], prev  # type: ignore[return-value]
    except BaseException:
        if prev is not None:
            prev.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if isinstance(out.get("next"), socket.socket):
            out["next"].close()  # type: ignore[union-attr]
        raise


# -- the communicator --------------------------------------------------------------------------

def _op_code(op, what: str) -> int:
    code = _OP_CODES.get(op) if isinstance(op, str) else None
    if code is None:
        raise CollectiveError(f"{what}: op must be one of {', '.join(OPS)}; got {op!r}")
    return code


def _reduce_code(dtype, op: str, what: str) -> int:
    """The engine's code for a dtype it reduces with ``op``; a CollectiveError naming the choices else."""
    code = _DTYPE_CODES.get(str(dtype))
    if code is None:
        raise CollectiveError(f"{what}: the native engine reduces {', '.join(DTYPES)}; got dtype {dtype} "
                              "(cast the array to one of them)")
    if str(dtype) == "bool" and op == "average":
        raise CollectiveError(f"{what}: bool has no average; use op 'sum' or 'max' (logical or), or 'min' or "
                              "'product' (logical and)")
    return code


def _move_code(dtype) -> int:
    """The engine's code for a dtype it only moves: its own where it has one, else opaque bytes."""
    code = _DTYPE_CODES.get(str(dtype))
    if code is not None:
        return code
    if dtype.hasobject or not 0 < dtype.itemsize <= _OPAQUE_MAX:
        raise CollectiveError(f"the native engine moves fixed-size dtypes of at most {_OPAQUE_MAX} bytes; got {dtype}")
    return _OPAQUE + dtype.itemsize


def _dims(shape):
    """A shape as the engine's (ndim, int64 array) arguments; the array must outlive the call."""
    arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    return len(shape), arr


def split_rows(rows: int, size: int) -> list[int]:
    """How many rows of ``rows`` each of ``size`` ranks keeps in a reducescatter, as Horovod splits
    them: ``rows // size`` each, one more for the first ``rows % size`` ranks.

    >>> split_rows(7, 3)
    [3, 2, 2]
    """
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


class Communicator:
    """One rank's handle on the engine. Every rank must make the same calls in the same order.

    Parameters
    ----------
    rank, size : this rank and the number of ranks.
    hosts : every rank's host, in rank order; ranks with the same host share memory.
    ports : every rank's TCP port; only the leaders of hosts (each host's first rank) listen,
        and only when there is more than one host (or ``force_tcp``).
    secret : the run's key; every ring connection proves it holds it (HMAC) before any data.
    name : unique to the run and attempt; names the shared-memory segments.
    timeout : seconds any collective (and the set-up) may wait for its peers.
    force_tcp : every rank is its own host, so ranks on one machine use the TCP ring.
    bind_host : the address to listen on; default: this rank's entry in ``hosts``.
    listener : an already bound, listening socket to use instead of binding ``ports[rank]``.
    spin : seconds a wait on a rank of this host spins before it sleeps (``spin_wait``); None:
        ``SPIN_S`` where this host's ranks do not outnumber its cores, else 0 (they sleep almost
        at once, leaving the cores to the ranks that still compute).
    """

    def __init__(self, rank: int, size: int, hosts: Sequence[str], ports: Sequence[int], secret: bytes, name: str,
                 timeout: float = 600.0, force_tcp: bool = False, bind_host: str | None = None,
                 chunk_bytes: int = 0, heartbeat: float | None = None, listener: socket.socket | None = None,
                 spin: float | None = None):
        lib = library()
        if lib is None:
            raise CollectiveError(unavailable_reason() or "the native engine is not available")
        if len(hosts) != size or len(ports) != size:
            raise CollectiveError(f"need {size} hosts and ports, got {len(hosts)} and {len(ports)}")
        self._lib = lib
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        nodes, locals_ = layout(hosts, force_tcp)
        self.node, self.local_rank = nodes[rank], locals_[rank]
        self.num_nodes = max(nodes) + 1
        self.local_size = sum(1 for n in nodes if n == self.node)
        self.spin = default_spin(self.local_size) if spin is None else float(spin)
        self.transport = "tcp" if self.num_nodes > 1 and self.local_size == 1 else (
            "shm" if self.num_nodes == 1 else "shm+tcp")
        leaders = [r for r in range(size) if locals_[r] == 0]
        deadline = time.monotonic() + self.timeout
        next_sock = prev_sock = None
        if self.num_nodes > 1 and self.local_rank == 0:
            nxt, prv = leaders[(self.node + 1) % self.num_nodes], leaders[(self.node - 1) % self.num_nodes]
            own = listener
            if own is None:
                own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                own.bind((bind_host or hosts[rank], int(ports[rank])))  # the executor's address, not 0.0.0.0
                own.listen(8)
            try:
                next_sock, prev_sock = _connect_ring(own, (hosts[nxt], int(ports[nxt])), secret, name.encode(), rank,
                                                     nxt, prv, deadline)
            finally:
                own.close()  # no listening socket outlives the set-up
            for s in (next_sock, prev_sock):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        shm = segment_name(name, self.node)
        node_arr = (ctypes.c_int32 * size)(*nodes)
        local_arr = (ctypes.c_int32 * size)(*locals_)
        cfg = _Config(rank=rank, size=size, local_rank=self.local_rank, local_size=self.local_size, node=self.node,
                      num_nodes=self.num_nodes, shm_name=shm.encode(), chunk_bytes=int(chunk_bytes),
                      timeout_s=max(0.001, deadline - time.monotonic()),
                      heartbeat_s=float(heartbeat if heartbeat is not None else min(30.0, self.timeout)),
                      next_fd=next_sock.fileno() if next_sock else -1, prev_fd=prev_sock.fileno() if prev_sock else -1,
                      rank_node=node_arr, rank_local=local_arr, spin_s=self.spin)
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = lib.stc_create(ctypes.byref(cfg), ctypes.byref(handle), err, _ERRLEN)
        if rc != 0:
            for s in (next_sock, prev_sock):
                if s is not None:
                    s.close()
            raise CollectiveError(f"rank {rank}: the native engine did not start: {err.value.decode(errors='replace')}")
        for s in (next_sock, prev_sock):
            if s is not None:
                s.detach()  # the engine owns the descriptors now
        self._handle = handle
        # One collective at a time: the handle and its message buffer are not for concurrent calls.
        self._lock = threading.Lock()
        self._cfg = cfg  # keeps the arrays alive for as long as the handle
        self._cfg.timeout_s = self.timeout
        self._err = err
        self._args_seen: dict = {}

    # -- calls -------------------------------------------------------------------------------
    def _call(self, fn, *args) -> None:
        with self._lock:
            self._check(fn(self._live(), *args, self._err, _ERRLEN))

    def _check(self, rc: int) -> None:
        if rc != 0:
            msg = self._err.value.decode(errors="replace")
            raise CollectiveError(f"rank {self.rank}: {msg}", rc)

    def _live(self):
        if self._handle is None:
            raise CollectiveError("the communicator is closed")
        return self._handle

    def _reduce_args(self, dtype, shape, op, what: str):
        """(dtype code, op code, ndim, dims) for a reduction, checked; remembered per dtype, shape
        and op, since a training step makes the same calls every time and small ones are
        dominated by this."""
        key = (dtype, shape, op, what) if isinstance(op, str) else None
        args = self._args_seen.get(key) if key else None
        if args is None:
            code = _op_code(op, what)
            args = (_reduce_code(dtype, op, what), code) + _dims(shape)
            if len(self._args_seen) >= 1024:
                self._args_seen.clear()
            self._args_seen[key] = args
        return args

    def allreduce(self, array, op: str = "average"):
        """A new array: ``array`` reduced over every rank with ``op`` (one of :data:`OPS`).

        Every rank must pass the same shape and dtype (one of :data:`DTYPES`). Averaged integers
        are divided with truncation toward zero; bool has no average.
        """
        import numpy as np

        out = np.array(array, order="C", copy=True)
        self._call(self._lib.stc_allreduce, out.ctypes.data, *self._reduce_args(out.dtype, out.shape, op, "allreduce"))
        return out

    def allreduce_(self, out, op: str = "average") -> None:
        """Reduce the C-contiguous, writable ``out`` in place (as :meth:`allreduce`)."""
        args = self._reduce_args(out.dtype, out.shape, op, "allreduce")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise CollectiveError("allreduce_ needs a C-contiguous, writable array")
        self._call(self._lib.stc_allreduce, out.ctypes.data, *args)

    def reducescatter(self, array, op: str = "average"):
        """``array`` reduced over every rank, of which this rank keeps its rows of axis 0.

        As Horovod splits them (:func:`split_rows`): ``rows // size`` rows each, one more for the
        first ``rows % size`` ranks, so with fewer rows than ranks the last ranks get none. Every
        rank passes the same shape (at least one dimension) and dtype.
        """
        import numpy as np

        code = _op_code(op, "reducescatter")
        a = np.array(array, order="C", copy=True)  # the engine's scratch
        dtype = _reduce_code(a.dtype, op, "reducescatter")
        rows = split_rows(a.shape[0], self.size) if a.ndim else [0] * self.size
        out = np.empty((rows[self.rank],) + a.shape[1:], a.dtype)
        ndim, dims = _dims(a.shape)
        self._call(self._lib.stc_reducescatter, a.ctypes.data, out.ctypes.data, dtype, code, ndim, dims)
        return out

    def broadcast(self, array, root: int = 0):
        """A new array holding ``array`` as it is on ``root`` (same shape and dtype on every rank)."""
        import numpy as np

        out = np.array(array, order="C", copy=True)
        ndim, dims = _dims(out.shape)
        self._call(self._lib.stc_broadcast, out.ctypes.data, _move_code(out.dtype), ndim, dims, int(root))
        return out

    def _gather_meta(self, meta):
        """Every rank's int64 vector ``meta`` (the same length on every rank), one row per rank."""
        import numpy as np

        meta = np.ascontiguousarray(meta, np.int64)
        return self._gatherv(meta.view(np.uint8), [meta.nbytes] * self.size, _DTYPE_CODES["int64"],
                             (meta.size,)).view(np.int64).reshape(self.size, meta.size)

    @staticmethod
    def _shape_text(meta_row) -> str:
        ndim, code = int(meta_row[0]), int(meta_row[1])
        name = DTYPES[code] if 0 <= code < len(DTYPES) else f"opaque{(code - _OPAQUE) * 8}"
        return f"{name}[{','.join(str(int(d)) for d in meta_row[2:2 + ndim])}]"

    def _meta_of(self, a, extra=()):
        """[ndim, dtype code, dims (padded to 64), *extra]: what a ragged collective compares."""
        import numpy as np

        meta = np.zeros(2 + _MAX_DIMS + len(extra), np.int64)
        meta[0], meta[1] = a.ndim, _move_code(a.dtype)
        meta[2:2 + a.ndim] = a.shape
        meta[2 + _MAX_DIMS:] = extra
        return meta

    def _check_ragged(self, what: str, metas) -> None:
        """The same verdict on every rank (each rank against rank 0): trailing dims and dtype agree."""
        for r in range(1, self.size):
            if metas[r, 0] != metas[0, 0] or metas[r, 1] != metas[0, 1] or \
                    (metas[r, 3:2 + _MAX_DIMS] != metas[0, 3:2 + _MAX_DIMS]).any():
                differ = "dtypes" if metas[r, 1] != metas[0, 1] else "shapes"
                raise CollectiveError(
                    f"rank {self.rank}: {what}: rank 0 passed {self._shape_text(metas[0])} but rank {r} passed "
                    f"{self._shape_text(metas[r])}: the {differ} differ (only the first dimension may differ)")

    def allgather(self, array):
        """Every rank's ``array`` concatenated along the first axis, in rank order.

        The first dimension may differ between ranks; the others and the dtype must match, else
        every rank raises the same :data:`MISMATCH` error and the communicator stays usable.
        """
        import numpy as np

        a = np.ascontiguousarray(array)
        if a.ndim == 0:
            a = a.reshape(1)
        # First every rank's shape and dtype, so a mismatch is an error and never garbage.
        metas = self._gather_meta(self._meta_of(a))
        self._check_ragged("allgather", metas)
        row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        counts = [int(metas[r, 2]) * row for r in range(self.size)]
        flat = self._gatherv(a.reshape(-1).view(np.uint8), counts, _move_code(a.dtype), a.shape)
        return flat.view(a.dtype).reshape((int(metas[:, 2].sum()),) + a.shape[1:])

    def alltoall(self, array, splits=None):
        """Send ``splits[i]`` rows of ``array``'s axis 0 to rank i; ``(received, received_splits)``.

        ``splits`` defaults to equal parts (the rows must then divide evenly over the ranks) and
        must sum to the rows; empty parts are fine. ``received`` is what every rank sent this one,
        concatenated in rank order; ``received_splits[i]`` is how many rows came from rank i. The
        trailing dims and the dtype must agree between ranks; a disagreement or bad splits on any
        rank is the same :data:`MISMATCH` error on every rank, and the communicator stays usable.
        """
        import numpy as np

        a = np.ascontiguousarray(array)
        n = self.size
        rows = a.shape[0] if a.ndim else 0
        # A problem with this rank's own splits is told to every rank (the meta carries it), so
        # that all of them raise instead of some waiting for the others.
        problem, given = 0, np.zeros(n, np.int64)
        if a.ndim == 0:
            problem = 1
        elif splits is None:
            if rows % n:
                problem = 2
            else:
                given[:] = rows // n
        else:
            sp = np.asarray(splits).reshape(-1)
            if sp.size != n or (sp.size and not np.issubdtype(sp.dtype, np.integer)):
                problem = 3
            elif (sp < 0).any():
                problem, given[:] = 4, sp
            elif int(sp.sum()) != rows:
                problem, given[:] = 5, sp
            else:
                given[:] = sp
        metas = self._gather_meta(self._meta_of(a, [problem, np.asarray(splits).size if splits is not None else n,
                                                    *given]))
        for r in range(n):
            p = int(metas[r, 2 + _MAX_DIMS])
            if p:
                shape = self._shape_text(metas[r])
                got = metas[r, 4 + _MAX_DIMS:].tolist()
                why = {1: "a scalar has no rows to send; pass an array of at least one dimension",
                       2: f"its {int(metas[r, 2])} rows do not split evenly over {n} ranks; pass splits",
                       3: f"splits must be {n} integers, one per rank (it passed {int(metas[r, 3 + _MAX_DIMS])} "
                          "values, or values that are not integers)",
                       4: f"splits {got} are negative",
                       5: f"splits {got} sum to {sum(got)}, not to its {int(metas[r, 2])} rows"}[p]
                raise CollectiveError(f"rank {self.rank}: alltoall: rank {r} passed {shape}: {why}")
        self._check_ragged("alltoall", metas)
        sent = metas[:, 4 + _MAX_DIMS:]  # sent[i][j]: rows from rank i to rank j
        row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        received_splits = sent[:, self.rank].astype(np.int64)
        out = np.empty((int(received_splits.sum()),) + a.shape[1:], a.dtype)
        sends = (ctypes.c_uint64 * (n * n))(*(sent.reshape(-1) * row).tolist())
        ndim, dims = _dims(a.shape)
        self._call(self._lib.stc_alltoallv, a.ctypes.data, out.ctypes.data, sends, _move_code(a.dtype), ndim, dims)
        return out, received_splits

    def _gatherv(self, data, counts: list[int], dtype: int, shape):
        import numpy as np

        out = np.empty(sum(counts), np.uint8)
        arr = (ctypes.c_uint64 * self.size)(*counts)
        ndim, dims = _dims(shape)
        self._call(self._lib.stc_allgatherv, data.ctypes.data, out.ctypes.data, arr, dtype, ndim, dims)
        return out

    def barrier(self) -> None:
        self._call(self._lib.stc_barrier)

    def make_current(self) -> None:
        """Make this the process's current communicator, the one code holding no handle (the
        TensorFlow kernels, ``sparktrain.tensorflow.kernels``) finds at run time; :meth:`close`
        clears it. Those callers and this object's calls must not overlap."""
        self._lib.stc_set_current(self._live())

    def is_current(self) -> bool:
        if getattr(self, "_handle", None) is None:
            return False
        current = self._lib.stc_current_acquire()
        self._lib.stc_current_release()
        return current == self._handle.value

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            with self._lock:
                if self.is_current():
                    self._lib.stc_set_current(None)  # waits for a kernel still running on it
                self._lib.stc_destroy(self._handle)
                self._handle = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- from a rank's environment -----------------------------------------------------------------

#: How long a wait spins, by default, where each of a host's ranks can have a core of its own:
#: longer than the usual skew between ranks' steps. On a 2-core virtual machine, a 4 KiB
#: allreduce inside a step took 68 us with waits that slept almost at once, 19 us spinning.
SPIN_S = 0.002


def default_spin(local_size: int) -> float:
    """``SPIN_S`` where ``local_size`` ranks do not outnumber this host's cores, else 0."""
    return SPIN_S if local_size <= (os.cpu_count() or 1) else 0.0

def from_env(timeout: float | None = None, environ=None) -> Communicator:
    """The communicator of a rank of ``sparktrain.run``, from its env contract.

    Addresses come from the run's rendezvous (``TF_CONFIG``: every rank's host and the port
    reserved for its collective runtime); the key from the file ``run`` wrote for this rank.
    """
    environ = os.environ if environ is None else environ
    timeout = settings.resolve("collective_timeout", timeout, environ=environ)
    try:
        cluster = json.loads(environ["TF_CONFIG"])["cluster"]["worker"]
        rank, size = int(environ["SPARKTRAIN_RANK"]), int(environ["SPARKTRAIN_SIZE"])
    except (KeyError, ValueError) as e:
        raise CollectiveError(f"the native engine needs the run's env contract (TF_CONFIG, SPARKTRAIN_RANK): {e}") \
            from None
    hosts = [w.rsplit(":", 1)[0] for w in cluster]
    ports = [int(w.rsplit(":", 1)[1]) for w in cluster]
    key_file = environ.get(KEY_FILE_ENV)
    if not key_file or not os.path.exists(key_file):
        raise CollectiveError(f"the native engine needs the run's key ({KEY_FILE_ENV}); is this a rank of "
                              "sparktrain.run?")
    with open(key_file, "rb") as f:
        key = f.read()
    name = f"{environ.get('SPARKTRAIN_RUN_ID', 'run')}-a{environ.get('SPARKTRAIN_ATTEMPT', '1')}"
    force_tcp = settings.resolve("cpu_transport", environ=environ) == "tcp"
    spin = settings.resolve("spin_wait", environ=environ)
    return Communicator(rank, size, hosts, ports, key, name, timeout=timeout, force_tcp=force_tcp,
                        spin=None if spin == "auto" else spin)
