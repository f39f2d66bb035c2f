"""Loading the engine's C library (``sparktrain/_collective.so``) and its ABI: return codes, the
ops and dtypes it knows, and the configuration struct it is created with."""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading

from ..seam import worker_env
from ..errors import SparkTrainError

LIBRARY_ENV = "SPARKTRAIN_NATIVE_LIBRARY"
#: The file holding the run's collective key; ``run`` writes it into the rank's work directory.
KEY_FILE_ENV = worker_env.COLLECTIVE_KEY_FILE

_ABI_VERSION = 7
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
        ("spin_s", ctypes.c_double), ("progress_path", ctypes.c_char_p),
        ("ring_keys", ctypes.c_char_p),
        ("host", ctypes.c_char_p), ("next_host", ctypes.c_char_p), ("prev_host", ctypes.c_char_p),
    ]


def move_code(dtype) -> int:
    """The engine's code for a dtype it only moves: its own where it has one, else opaque bytes."""
    code = _DTYPE_CODES.get(str(dtype))
    if code is not None:
        return code
    if dtype.hasobject or not 0 < dtype.itemsize <= _OPAQUE_MAX:
        raise CollectiveError(f"the native engine moves fixed-size dtypes of at most {_OPAQUE_MAX} bytes; got {dtype}")
    return _OPAQUE + dtype.itemsize


_lib = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _library_path() -> str | None:
    """``$SPARKTRAIN_NATIVE_LIBRARY``, else the package's ``_collective.so`` (in site-packages from a
    wheel, in the checkout's ``sparktrain/`` in an editable install), else one a checkout built
    before the file lost its interpreter suffix (``_collective.cpython-311-x86_64-linux-gnu.so``)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return override
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    for suffix in (".so", *importlib.machinery.EXTENSION_SUFFIXES):
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
            _lib_error = ("sparktrain's native collective engine was not built (no sparktrain/_collective.so); "
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
        lib.stc_comm_traffic.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
        lib.stc_comm_traffic.restype = None
        lib.stc_set_current.argtypes = [ctypes.c_void_p]
        lib.stc_set_current.restype = None
        lib.stc_current_acquire.argtypes = []
        lib.stc_current_acquire.restype = ctypes.c_void_p
        lib.stc_current_release.argtypes = []
        lib.stc_current_release.restype = None
        cp, sz = ctypes.c_char_p, ctypes.c_size_t
        lib.stc_crypto_available.argtypes = [err, sz]
        lib.stc_hkdf_sha256.argtypes = [cp, sz, cp, sz, cp, sz, cp, sz, err, sz]
        lib.stc_aead_seal.argtypes = [cp, cp, sz, cp, sz, cp, sz, cp, cp, err, sz]
        lib.stc_aead_open.argtypes = [cp, cp, sz, cp, sz, cp, sz, cp, cp, err, sz]
        _lib = lib
        return _lib


def unavailable_reason() -> str | None:
    """Why the engine cannot be used here, or None when it can."""
    library()
    return _lib_error


def crypto_unavailable(lib=None) -> str | None:
    """Why the engine cannot encrypt its ring here (no libcrypto, or no engine), or None when it can."""
    lib = lib or library()
    if lib is None:
        return unavailable_reason()
    msg = ctypes.create_string_buffer(_ERRLEN)
    return None if lib.stc_crypto_available(msg, _ERRLEN) == 0 else msg.value.decode(errors="replace")


def available() -> bool:
    return library() is not None


