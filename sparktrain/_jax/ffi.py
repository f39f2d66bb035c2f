"""The native engine's XLA FFI handlers for JAX on CPU (``native/jax_ffi.cc``): built at first use,
cached, registered with JAX, and called from inside a compiled step: :func:`allreduce` reduces on
XLA's thread; :func:`bucket` hands a gradient bucket to the engine's thread (``native/reducer.h``)
and XLA goes on with what does not read it.

pip builds sparktrain without jaxlib, so the handler is compiled here, when a rank's ``init()``
starts the engine: with ``$CXX`` (default ``g++``) against jaxlib's FFI headers
(``jax.ffi.include_dir()``) and linked against the engine library the process has loaded (by its
path, with an rpath), so the handler finds the communicator ``init()`` made current. The library
goes to the cache directory the TensorFlow kernels use (``sparktrain.engine.kernel_cache``), named
by jaxlib's version and a hash of what it is built from, compiled in the temp dir and renamed into
place under a file lock: a host compiles once, later runs never.

Where it cannot be built or loaded (no compiler, no headers), the rank logs one warning, and a
``DistributedOptimizer`` step on CPU raises, naming the fix; ``SPARKTRAIN_JAX_FFI=0`` chooses
``jax.pure_callback`` instead (``collectives``), which copies each buffer to the host through a
transfer that XLA's CPU client may queue behind the step that waits for it. No TensorFlow is
imported here.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time

from ..engine import kernel_cache

#: ``SPARKTRAIN_JAX_FFI=0``: reduce through ``jax.pure_callback``, not the FFI handler.
SWITCH_ENV = "SPARKTRAIN_JAX_FFI"
SOURCE, HEADER = "jax_ffi.cc", "collective.h"
#: Every file the library is built from (compiled: the ``.cc`` ones); all are in its hash.
SOURCES = (SOURCE, "reducer.cc", "reducer.h", "engine_op.h", HEADER)
#: The names the handlers are registered under (``jax.ffi.register_ffi_target``).
TARGET, BUCKET_TARGET = "sparktrain_allreduce", "sparktrain_allreduce_bucket"
#: Seconds one compile may take, and one rank may wait for another's.
COMPILE_TIMEOUT = 120.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}  # "ready": True once registered; "failure": why not


def source_dir() -> str | None:
    """Where :data:`SOURCES` are: the package's copy (a wheel), else ``native/``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    for d in (os.path.join(here, "_native"), os.path.join(os.path.dirname(here), "native")):
        if all(os.path.exists(os.path.join(d, name)) for name in SOURCES):
            return d
    return None


def library_path(src: str, include: str, engine_path: str, cxx: str) -> str:
    """The cached library's path: jaxlib's version and a hash of everything it is built from."""
    import jaxlib

    from .. import engine

    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(src, name), "rb") as f:
            h.update(f.read())
    h.update(f"{engine._ABI_VERSION}|{os.path.realpath(engine_path)}|{cxx}|{include}".encode())
    return os.path.join(kernel_cache.cache_dir(), f"jax_ffi-{jaxlib.__version__}-{h.hexdigest()[:16]}.so")


def _compile(cxx: str, src: str, include: str, engine_path: str, out: str) -> None:
    """Compile in the temp dir, copy beside ``out`` and rename it there (atomic)."""
    with tempfile.TemporaryDirectory(prefix="sparktrain-jax-ffi-") as work:
        built = os.path.join(work, "jax_ffi.so")
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-w", "-I", include, "-I", src,
               *[os.path.join(src, name) for name in SOURCES if name.endswith(".cc")], "-o", built, engine_path, "-Wl,-rpath," + os.path.dirname(engine_path)]
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMPILE_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise OSError(f"{cxx} took longer than {COMPILE_TIMEOUT:.0f} s") from None
        if done.returncode != 0:
            text = done.stdout.decode(errors="replace").strip().splitlines()
            raise OSError(f"{cxx} failed (exit {done.returncode}): {' '.join(text[-3:])[:600]}")
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".jax_ffi-", suffix=".so.tmp")
        try:
            with os.fdopen(fd, "wb") as f, open(built, "rb") as g:
                shutil.copyfileobj(g, f)
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def build() -> str:
    """The handler library's path, compiled first where the cache lacks it; OSError why not."""
    import jax

    from .. import engine

    src = source_dir()
    engine_path = engine._library_path()
    cxx = os.environ.get(kernel_cache.CXX_ENV) or "g++"
    if src is None or engine_path is None:
        raise OSError(f"the sources ({', '.join(SOURCES)}) or the engine library are not installed")
    if shutil.which(cxx) is None:
        raise OSError(f"no C++ compiler ({cxx}) on this host")
    include = jax.ffi.include_dir()
    out = library_path(src, include, engine_path, cxx)
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd = os.open(out + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + COMPILE_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"waited {COMPILE_TIMEOUT:.0f} s for another process compiling {out}") from None
                time.sleep(0.05)
        if not os.path.exists(out):  # another rank may have built it while this one waited
            _compile(cxx, src, include, engine_path, out)
    finally:
        os.close(fd)
    return out


def ready() -> bool:
    """Whether the handler is registered with JAX (built and loaded at the first call; a failure is
    logged once and kept, and the caller reduces through ``jax.pure_callback``)."""
    with _lock:
        if "ready" in _state or "failure" in _state:
            return _state.get("ready", False)
        if turned_off():
            _state["failure"] = f"turned off ({SWITCH_ENV}=0)"
            return False
        try:
            import ctypes

            import jax

            from .. import engine

            path = build()
            lib = ctypes.CDLL(path)
            if lib.sparktrain_jax_ffi_abi_version() != engine._ABI_VERSION:
                raise OSError(f"{path} was built for engine ABI {lib.sparktrain_jax_ffi_abi_version()}")
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SparktrainJaxAllreduce), platform="cpu")
            jax.ffi.register_ffi_target(BUCKET_TARGET, jax.ffi.pycapsule(lib.SparktrainJaxBucket), platform="cpu")
            _state["ready"], _state["lib"] = True, lib
        except Exception as e:  # noqa: BLE001 - any failure means the pure_callback path, said once
            _state["failure"] = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            _log.warning("sparktrain's XLA FFI handler for the native engine is not available: %s",
                         _state["failure"])
            return False
        return True


def turned_off() -> bool:
    """Whether ``SPARKTRAIN_JAX_FFI=0`` chose the ``jax.pure_callback`` path."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def failure() -> str | None:
    """Why the handler is not in use, once :func:`ready` said so; None otherwise."""
    return _state.get("failure")


def allreduce(flat, op_code: int):
    """``flat`` (a 1-d JAX array) reduced over every rank in the handler, inside the step."""
    import jax
    import numpy as np

    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                            input_output_aliases={0: 0})(flat, op=np.int32(op_code))


def bucket(flat, op_code: int, after: list):
    """``flat`` (a 1-d JAX array, one gradient bucket) reduced over every rank on the engine's thread
    while the step goes on; ``after``: the arrays of the bucket before it (none for the first), which
    the call waits for and does not read, so every rank hands the engine its buckets in this order."""
    import jax
    import numpy as np

    return jax.ffi.ffi_call(BUCKET_TARGET, jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                            input_output_aliases={0: 0})(flat, *after, op=np.int32(op_code))


def stop() -> None:
    """Fail the buckets waiting for the engine's thread and join it (``shutdown()``), where the
    library is loaded; the next bucket starts the thread again."""
    lib = _state.get("lib")
    if lib is not None:
        lib.sparktrain_jax_ffi_stop()
