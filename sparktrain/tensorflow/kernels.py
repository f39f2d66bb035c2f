"""TensorFlow kernels over the native CPU collective engine: built at first use, cached, loaded.

On the native engine every collective of ``sparktrain.tensorflow`` is a TensorFlow op whose CPU
kernel (``native/tf_kernels.cc``) calls the engine's C ABI directly: no Python, no GIL, no
``tf.numpy_function``, so a collective inside a compiled step costs little more than the
engine's own time, and the engine's failures surface as TensorFlow's errors even inside a
``tf.function`` (``FailedPreconditionError`` when ranks disagree, ``DeadlineExceededError``,
``UnavailableError``).

pip builds sparktrain without TensorFlow, so the kernels are compiled here, the first time a
rank's ``init()`` brings the engine up: with ``$CXX`` (default ``g++``) and TensorFlow's own
compile and link flags (``tf.sysconfig``), linked against the engine library
``sparktrain.engine`` loaded (by its path, with an rpath, so the process holds one engine and
the kernels find the communicator ``init()`` made current). The library goes to a cache
directory (``sparktrain.engine.kernel_cache``: ``$SPARKTRAIN_CACHE_DIR``, else ``~/.cache/sparktrain``,
else this user's own 0700 directory under the temp dir), named by TensorFlow's version and a hash
of the sources, the engine's ABI and path, the compiler and the TensorFlow installation: it is
compiled in this host's temp dir, copied beside its name and renamed into place, under a file
lock, so the ranks of one host compile once and later runs compile never.
``sparktrain check --build`` compiles it ahead of a run.

Where the kernels cannot be built or loaded (no compiler, no TensorFlow headers), each rank logs
one warning saying why and runs its collectives through ``tf.numpy_function`` as before;
``SPARKTRAIN_TF_KERNELS=0`` (or ``spark.sparktrain.tfKernels``) asks for that path without a
warning. Adasum always takes it (in a TensorFlow 1 graph, where the kernels run in the order
the ranks agree on through their own sequencer, ``native/tf_sequencer.cc``, it is refused).
"""
from __future__ import annotations

import ctypes
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
from ..engine.kernel_cache import CACHE_ENV, CXX_ENV, HEADER, SOURCE, SOURCES, cache_dir  # noqa: F401 - this API's names
from ..settings import rank as rank_settings

#: Seconds one compile may take, and one rank may wait for another's.
COMPILE_TIMEOUT = 300.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded = None  # (op module, ctypes library) once loaded
_failure: str | None = None  # why not, once tried
_warned = False
_source_dir = kernel_cache.source_dir


def _flags(tf) -> tuple[list[str], list[str]]:
    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def _compile(tf, cxx: str, src: str, engine: str, out: str) -> None:
    """Compile in a directory of this host's temp dir, copy the library beside ``out`` and rename
    it there (atomic): a shared cache (NFS, a volume) never holds a partial library under its name.

    The ``.cc`` sources are one translation unit (a list of includes on the compiler's stdin):
    TensorFlow's headers, most of the compile's time, are then read once, not once per file."""
    compile_flags, link_flags = _flags(tf)
    unit = "".join(f'#include "{os.path.join(src, name)}"\n' for name in SOURCES if name.endswith(".cc"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sparktrain-kernels-") as work:
        built = os.path.join(work, os.path.basename(out))
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wno-deprecated-declarations", *compile_flags,
               "-I", src, "-x", "c++", "-", "-x", "none", "-o", built, engine,
               "-Wl,-rpath," + os.path.dirname(engine), *link_flags]
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMPILE_TIMEOUT,
                                  input=unit.encode())
        except subprocess.TimeoutExpired:
            raise OSError(f"{cxx} took longer than {COMPILE_TIMEOUT:.0f} s") from None
        if done.returncode != 0:
            text = done.stdout.decode(errors="replace").strip().splitlines()
            errors = [line for line in text if "error" in line] or text
            raise OSError(f"{cxx} failed (exit {done.returncode}): {' '.join(errors[-3:])[:600]}")
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".tf_kernels-", suffix=".so.tmp")
        try:
            with os.fdopen(fd, "wb") as f, open(built, "rb") as g:
                shutil.copyfileobj(g, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _log.info("sparktrain: compiled the TensorFlow kernels in %.1f s into %s", time.monotonic() - started, out)


def _open_lock(path: str) -> int:
    """A file to ``flock``: ``path`` in the cache, or, where that file system has no working ``flock``
    (some network and FUSE mounts), one of this host's own under the temp dir."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return fd
    except BlockingIOError:
        return fd  # works: another process holds it
    except OSError:
        os.close(fd)
    local = kernel_cache.private_temp_dir("sparktrain-cache")
    if local is None:
        raise OSError(f"cannot lock {path}, nor a lock of this host's under {tempfile.gettempdir()}")
    name = hashlib.sha256(os.path.dirname(os.path.abspath(path)).encode()).hexdigest()[:16]
    return os.open(os.path.join(local, f"tf_kernels-{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)


def _locked(path: str, deadline: float):
    """An exclusive ``flock`` on ``path`` (see :func:`_open_lock`), waited for until ``deadline`` (monotonic)."""
    fd = _open_lock(path)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OSError(f"waited {COMPILE_TIMEOUT:.0f} s for another process compiling the kernels "
                              f"({path})") from None
            time.sleep(0.05)


def build(tf=None) -> str:
    """The path of the kernels' library, compiled first where the cache lacks it; OSError why not.

    A host compiles once: its processes take turns on a file lock, and each looks for the library
    again once it holds the lock. Hosts that share the cache (``SPARKTRAIN_CACHE_DIR`` on a shared
    mount) lock each other out where the mount's ``flock`` spans hosts, and otherwise each compile
    once and publish the same library by an atomic rename."""
    tf = tf or __import__("tensorflow")
    t = kernel_cache.target()
    if os.path.exists(t.library):
        return t.library
    why = kernel_cache.missing_tools(t)
    if why is not None:
        raise OSError(why)
    os.makedirs(t.directory, exist_ok=True)
    fd = _locked(os.path.join(t.directory, "tf_kernels.lock"), time.monotonic() + COMPILE_TIMEOUT)
    try:
        if not os.path.exists(t.library):  # another rank may have built it while this one waited
            _compile(tf, t.cxx, t.src, t.engine, t.library)
    finally:
        os.close(fd)  # releases the lock
    return t.library


def load():
    """The loaded kernels, ``(ops module, ctypes library)``, or None (see :func:`failure`).

    Built and loaded once per process; the first failure logs one warning and is kept.
    """
    global _loaded, _failure, _warned
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        if not rank_settings.current().tf_kernels:
            _failure = "turned off (SPARKTRAIN_TF_KERNELS=0)"
            return None
        try:
            import tensorflow as tf

            from .. import engine

            path = build(tf)
            ops = tf.load_op_library(path)
            lib = ctypes.CDLL(path)
            if lib.sparktrain_tk_abi_version() != engine._ABI_VERSION:
                raise OSError(f"{path} was built for engine ABI {lib.sparktrain_tk_abi_version()}, not "
                              f"{engine._ABI_VERSION}")
            lib.sparktrain_tk_timeline.argtypes = [ctypes.c_int]
            lib.sparktrain_tk_timeline.restype = None
            lib.sparktrain_tk_timeline_drain.restype = ctypes.c_void_p
            lib.sparktrain_tk_free.argtypes = [ctypes.c_void_p]
            lib.sparktrain_tk_free.restype = None
            lib.sparktrain_tk_sequencer_timeout.argtypes = [ctypes.c_double]
            lib.sparktrain_tk_sequencer_timeout.restype = None
            lib.sparktrain_tk_sequencer_stop.argtypes = []
            lib.sparktrain_tk_sequencer_stop.restype = None
            _loaded = (ops, lib)
        except Exception as e:  # noqa: BLE001 - any failure means the fallback, said once
            _failure = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
            if not _warned:
                _warned = True
                _log.warning("sparktrain's TensorFlow kernels for the native engine are not available (%s); "
                             "collectives run through tf.numpy_function instead, slower inside tf.function. "
                             "Install a C++ compiler (apt-get install g++, or set CXX) where the ranks run, build them "
                             "ahead into a shared SPARKTRAIN_CACHE_DIR (sparktrain check --build), or set "
                             "SPARKTRAIN_TF_KERNELS=0 to choose that path without this warning", _failure)
            return None
        if _timeline_on:  # a timeline started before the kernels loaded
            lib.sparktrain_tk_timeline(1)
        return _loaded


def failure() -> str | None:
    """Why the kernels are not loaded (None when they are, or were not tried)."""
    return _failure


def ops():
    """The kernels' op module when loaded, else None (never builds)."""
    return _loaded[0] if _loaded is not None else None


def set_timeout(seconds: float) -> None:
    """The collective timeout, after which ranks whose TensorFlow 1 graph collectives agree on
    nothing fail them (the sequencer of ``native/tf_sequencer.cc``)."""
    if _loaded is not None:
        _loaded[1].sparktrain_tk_sequencer_timeout(float(seconds))


def stop_sequencer() -> None:
    """Fail the collectives still waiting for their turn (TensorFlow 1 graphs' and gradient
    buckets' on the engine's thread) and join both threads (``shutdown()``, before the
    communicator closes); each starts again with the next one."""
    if _loaded is not None:
        _loaded[1].sparktrain_tk_sequencer_stop()


#: Whether the kernels record a timeline: set by ``timeline`` (which imports this module, never
#: the other way round) and applied when the kernels load.
_timeline_on = False


def set_timeline(on: bool) -> None:
    global _timeline_on
    _timeline_on = bool(on)
    if _loaded is not None:
        _loaded[1].sparktrain_tk_timeline(1 if on else 0)


def drain_timeline() -> list[tuple[str, int, float, float, float]]:
    """The collectives the kernels ran since the last drain: ``(label, bytes, start_us, end_us,
    queued_us)``; ``queued_us`` is when one run on the engine's thread (a gradient bucket) was handed
    over, 0 for one run in place."""
    if _loaded is None:
        return []
    lib = _loaded[1]
    p = lib.sparktrain_tk_timeline_drain()
    if not p:
        return []
    try:
        text = ctypes.string_at(p).decode(errors="replace")
    finally:
        lib.sparktrain_tk_free(p)
    events = []
    for line in text.splitlines():
        label, nbytes, start, end, queued = line.rsplit("\t", 4)
        events.append((label, int(nbytes), float(start), float(end), float(queued)))
    return events
