"""The :class:`Communicator`: one rank's handle on the engine, with numpy arrays in and out."""
from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from typing import Sequence

from ..host import cpus
from ..seam import worker_env
from .handshake import MODE_AEAD, MODE_CLEAR, _connect_ring, ring_keys
from .ragged import check_ragged, meta_of, sent_rows, split_problem, splits_refused
from .loader import (CollectiveError, crypto_unavailable, DTYPES, OPS, _Config, _DTYPE_CODES, _ERRLEN, _OP_CODES, library,
                     move_code, unavailable_reason)
from .topology import layout, segment_name


#: How long a wait spins, by default, where each of a host's ranks can have a CPU of its own:
#: longer than the usual skew between ranks' steps, so that a small collective inside a step
#: does not pay for a sleep and a wake-up.
SPIN_S = 0.002


def default_spin(local_size: int, budget: int | None = None) -> float:
    """``SPIN_S`` where this host's ``local_size`` ranks do not outnumber the CPUs they can use
    together, else 0: a spinning rank would take the CPU its peer needs.

    ``budget`` defaults to what the rank's task measured (``worker_env.CPU_BUDGET``: the affinity
    mask and cgroup quota of the executor, capped by Spark's task CPUs), or else what this
    process can use (``sparktrain.host.cpus.usable_cpus``).
    """
    if budget is None:
        given = os.environ.get(worker_env.CPU_BUDGET, "")
        budget = int(given) if given.isdigit() else cpus.usable_cpus()
    return SPIN_S if local_size <= budget else 0.0


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
    progress : a file where the engine keeps the record of which collective this rank is in and
        since when (``stc_progress``), which the rank's task reads to report stalls; None: none.
    encrypt : every byte between hosts travels in AES-256-GCM records, under keys derived from
        ``secret`` for each connection and direction (``sparktrain.engine.handshake``); shared
        memory within a host stays in clear. Fails where libcrypto cannot be loaded.
    """

    def __init__(self, rank: int, size: int, hosts: Sequence[str], ports: Sequence[int], secret: bytes, name: str,
                 timeout: float = 600.0, force_tcp: bool = False, bind_host: str | None = None,
                 chunk_bytes: int = 0, heartbeat: float | None = None, listener: socket.socket | None = None,
                 spin: float | None = None, progress: str | None = None, encrypt: bool = False):
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
        keys = None
        self.encrypted = bool(encrypt) and self.num_nodes > 1
        if self.encrypted and self.local_rank == 0:
            why = crypto_unavailable(lib)
            if why:
                raise CollectiveError(f"rank {rank}: encryption is on, but {why}")
        if self.num_nodes > 1 and self.local_rank == 0:
            nxt, prv = leaders[(self.node + 1) % self.num_nodes], leaders[(self.node - 1) % self.num_nodes]
            own = listener
            if own is None:
                own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                own.bind((bind_host or hosts[rank], int(ports[rank])))  # the executor's address, not 0.0.0.0
                own.listen(8)
            mode = MODE_AEAD if self.encrypted else MODE_CLEAR
            try:
                next_sock, prev_sock, next_salt, prev_salt = _connect_ring(
                    own, (hosts[nxt], int(ports[nxt])), secret, name.encode(), rank, nxt, prv, deadline, mode)
                if self.encrypted:
                    keys = ring_keys(lib, secret, name.encode(), rank, nxt, prv, next_salt, prev_salt)
            except BaseException:
                for s in (next_sock, prev_sock):
                    if s is not None:
                        s.close()
                raise
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
                      rank_node=node_arr, rank_local=local_arr, spin_s=self.spin,
                      progress_path=progress.encode() if progress else None, ring_keys=keys,
                      host=hosts[rank].encode(), next_host=hosts[leaders[(self.node + 1) % self.num_nodes]].encode(),
                      prev_host=hosts[leaders[(self.node - 1) % self.num_nodes]].encode())
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
        self._call(self._lib.stc_broadcast, out.ctypes.data, move_code(out.dtype), ndim, dims, int(root))
        return out

    def _gather_meta(self, meta):
        """Every rank's int64 vector ``meta`` (the same length on every rank), one row per rank."""
        import numpy as np

        meta = np.ascontiguousarray(meta, np.int64)
        return self._gatherv(meta.view(np.uint8), [meta.nbytes] * self.size, _DTYPE_CODES["int64"],
                             (meta.size,)).view(np.int64).reshape(self.size, meta.size)

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
        metas = self._gather_meta(meta_of(a))
        check_ragged(self.rank, "allgather", metas)
        row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        counts = [int(metas[r, 2]) * row for r in range(self.size)]
        flat = self._gatherv(a.reshape(-1).view(np.uint8), counts, move_code(a.dtype), a.shape)
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
        # A problem with this rank's own splits is told to every rank (the meta carries it), so
        # that all of them raise instead of some waiting for the others.
        metas = self._gather_meta(meta_of(a, split_problem(a, splits, n)))
        problem = splits_refused(metas, n)
        if problem:
            raise CollectiveError(f"rank {self.rank}: alltoall: {problem}")
        check_ragged(self.rank, "alltoall", metas)
        sent = sent_rows(metas)  # sent[i][j]: rows from rank i to rank j
        row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        received_splits = sent[:, self.rank].astype(np.int64)
        out = np.empty((int(received_splits.sum()),) + a.shape[1:], a.dtype)
        sends = (ctypes.c_uint64 * (n * n))(*(sent.reshape(-1) * row).tolist())
        ndim, dims = _dims(a.shape)
        self._call(self._lib.stc_alltoallv, a.ctypes.data, out.ctypes.data, sends, move_code(a.dtype), ndim, dims)
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

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received over this rank's ring connections so far (a host leader's)."""
        sent, received = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.stc_comm_traffic(self._live(), ctypes.byref(sent), ctypes.byref(received))
        return sent.value, received.value

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


