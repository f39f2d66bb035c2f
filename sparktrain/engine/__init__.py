"""The native CPU collective engine (``native/``), seen from Python.

The package, by subject: ``loader`` (loading the C library, its ABI), ``topology`` (where each
rank sits), ``handshake`` (the ring's authenticated connections), ``ragged`` (what allgather and
alltoall compare first), ``communicator`` (the :class:`Communicator`), ``progress`` (reading where a
rank's collectives stand), and here, a communicator from a rank's environment.

The engine is a small C library built into the package (``sparktrain/_collective.so``) and
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

import json
import os

from ..settings import rank as rank_settings
from .. import settings
from ..seam import worker_env
from .communicator import SPIN_S, Communicator, default_spin, split_rows
from .loader import (_ABI_VERSION, BROKEN, DTYPES, KEY_FILE_ENV, LIBRARY_ENV, MISMATCH, OPS, PEER, TIMEOUT,  # noqa: F401
                      CollectiveError, _library_path, available, crypto_unavailable, library, unavailable_reason)
from .topology import layout, segment_name  # noqa: F401

__all__ = ["BROKEN", "DTYPES", "MISMATCH", "OPS", "PEER", "SPIN_S", "TIMEOUT", "CollectiveError", "Communicator",
           "available", "contract", "crypto_unavailable", "default_spin", "from_env", "layout", "library", "segment_name", "split_rows",
           "unavailable_reason"]


def from_env(timeout: float | None = None, environ=None) -> Communicator:
    """The communicator of a rank of ``sparktrain.run``, from its env contract.

    Addresses come from the run's rendezvous (``TF_CONFIG``: every rank's host and the port
    reserved for its collective runtime); the key from the file ``run`` wrote for this rank.
    """
    c = contract(timeout, environ)
    return Communicator(c["rank"], c["size"], c["hosts"], c["ports"], c["secret"], c["name"], timeout=c["timeout"],
                        force_tcp=c["force_tcp"], spin=c["spin"], progress=c["progress"], encrypt=c["encrypt"])


def contract(timeout: float | None = None, environ=None) -> dict:
    """What a rank of ``sparktrain.run`` needs for a communicator, from its env: ``rank``, ``size``,
    ``hosts``, ``ports``, ``secret``, ``name``, ``timeout``, ``force_tcp``, ``spin``, ``progress`` and
    ``encrypt`` (the arguments of :class:`Communicator`; a process set's communicator uses them too).
    ``encrypt`` follows SPARKTRAIN_ENCRYPTION, which ``run`` sets to what it resolved ("auto" here,
    where no Spark conf is at hand, is off)."""
    values = rank_settings.current() if environ is None else rank_settings.parse(environ)
    environ = os.environ if environ is None else environ
    timeout = values.collective_timeout if timeout is None else settings.parse_value("collective_timeout", timeout)
    try:
        cluster = json.loads(environ["TF_CONFIG"])["cluster"]["worker"]
        rank, size = int(environ[worker_env.RANK]), int(environ[worker_env.SIZE])
    except (KeyError, ValueError) as e:
        raise CollectiveError(f"the native engine needs the run's env contract (TF_CONFIG, SPARKTRAIN_RANK): {e}") \
            from None
    key_file = environ.get(KEY_FILE_ENV)
    if not key_file or not os.path.exists(key_file):
        raise CollectiveError(f"the native engine needs the run's key ({KEY_FILE_ENV}); is this a rank of "
                              "sparktrain.run?")
    with open(key_file, "rb") as f:
        key = f.read()
    spin = values.spin_wait
    return dict(rank=rank, size=size, hosts=[w.rsplit(":", 1)[0] for w in cluster],
                ports=[int(w.rsplit(":", 1)[1]) for w in cluster], secret=key,
                name=f"{environ.get(worker_env.RUN_ID, 'run')}-a{environ.get(worker_env.ATTEMPT, '1')}",
                timeout=timeout, force_tcp=values.cpu_transport == "tcp",
                spin=None if spin == "auto" else spin, progress=environ.get(worker_env.PROGRESS_FILE),
                encrypt=values.encryption == "on")
