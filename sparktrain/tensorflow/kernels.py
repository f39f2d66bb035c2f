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
directory, ``$SPARKTRAIN_CACHE_DIR`` or else ``~/.cache/sparktrain`` (a directory under the temp
dir where HOME is not writable), named by TensorFlow's version and a hash of the sources, the
engine's ABI and path, and the compiler: it is compiled into a temporary file and renamed into
place, under a file lock, so the ranks of one host compile once and later runs compile never.

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

from ..settings import rank as rank_settings

#: ``SPARKTRAIN_CACHE_DIR``: where compiled kernels are kept (default ``~/.cache/sparktrain``).
CACHE_ENV = "SPARKTRAIN_CACHE_DIR"
#: ``CXX``: the C++ compiler (default ``g++``).
CXX_ENV = "CXX"
SOURCE = "tf_kernels.cc"
HEADER = "collective.h"
#: Every file the library is built from (compiled: the ``.cc`` ones); all are in its hash.
SOURCES = (SOURCE, "tf_ragged_kernels.cc", "tf_kernel.h", "tf_sequencer.cc", "tf_sequencer.h", HEADER)
#: Seconds one compile may take, and one rank may wait for another's.
COMPILE_TIMEOUT = 300.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded = None  # (op module, ctypes library) once loaded
_failure: str | None = None  # why not, once tried
_warned = False


def _source_dir() -> str | None:
    """Where the kernels' :data:`SOURCES` are: the package's copy (an installed wheel), else the
    source tree's ``native/`` (an editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (os.path.join(here, "_native"), os.path.join(os.path.dirname(here), "native")):
        if all(os.path.exists(os.path.join(d, name)) for name in SOURCES):
            return d
    return None


def cache_dir(environ=None) -> str:
    """``$SPARKTRAIN_CACHE_DIR``, else ``~/.cache/sparktrain``, else one under the temp dir."""
    environ = os.environ if environ is None else environ
    candidates = []
    if environ.get(CACHE_ENV):
        candidates.append(environ[CACHE_ENV])
    home = os.path.expanduser("~")
    if home and home != "~":
        candidates.append(os.path.join(home, ".cache", "sparktrain"))
    candidates.append(os.path.join(tempfile.gettempdir(), f"sparktrain-cache-{os.getuid()}"))
    for d in candidates:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK | os.X_OK):
            return d
    raise OSError(f"no writable cache directory among {', '.join(candidates)}; set {CACHE_ENV}")


def _flags(tf) -> tuple[list[str], list[str]]:
    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def library_path(tf, engine: str, src: str, cxx: str, directory: str) -> str:
    """The cached library's path for this TensorFlow, source, engine and compiler."""
    from .. import engine as _engine

    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(src, name), "rb") as f:
            h.update(f.read())
    compile_flags, link_flags = _flags(tf)
    for part in (str(_engine._ABI_VERSION), os.path.realpath(engine), cxx, *compile_flags, *link_flags):
        h.update(b"\0" + part.encode())
    return os.path.join(directory, f"tf_kernels-tf{tf.__version__}-{h.hexdigest()[:16]}.so")


def _compile(tf, cxx: str, src: str, engine: str, out: str) -> None:
    """Compile into a temporary file beside ``out``, then rename it there (atomic).

    The ``.cc`` sources are one translation unit (a list of includes on the compiler's stdin):
    TensorFlow's headers, most of the compile's time, are then read once, not once per file."""
    compile_flags, link_flags = _flags(tf)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".tf_kernels-", suffix=".so.tmp")
    os.close(fd)
    unit = "".join(f'#include "{os.path.join(src, name)}"\n' for name in SOURCES if name.endswith(".cc"))
    try:
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wno-deprecated-declarations", *compile_flags,
               "-I", src, "-x", "c++", "-", "-x", "none", "-o", tmp, engine,
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
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _locked(path: str, deadline: float):
    """An exclusive ``flock`` on ``path``, waited for until ``deadline`` (monotonic)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
    """The path of the kernels' library, compiled first where the cache lacks it; OSError why not."""
    from .. import engine as _engine

    tf = tf or __import__("tensorflow")
    engine = _engine._library_path()
    if engine is None or not _engine.available():
        raise OSError(_engine.unavailable_reason() or "the native engine is not available")
    engine = os.path.abspath(engine)
    src = _source_dir()
    if src is None:
        raise OSError(f"the kernels' source ({SOURCE}) is not in this installation of sparktrain")
    cxx = os.environ.get(CXX_ENV) or "g++"
    directory = os.path.join(cache_dir(), "tf_kernels")
    os.makedirs(directory, exist_ok=True)
    out = library_path(tf, engine, src, cxx, directory)
    if os.path.exists(out):
        return out
    if shutil.which(cxx) is None:
        raise OSError(f"no C++ compiler: {cxx!r} is not on PATH")
    fd = _locked(os.path.join(directory, "tf_kernels.lock"), time.monotonic() + COMPILE_TIMEOUT)
    try:
        if not os.path.exists(out):  # another rank may have built it while this one waited
            _compile(tf, cxx, src, engine, out)
    finally:
        os.close(fd)  # releases the lock
    return out


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
                             "Install a C++ compiler (apt-get install g++, or set CXX) where the ranks run, or set "
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
    """Fail the TensorFlow 1 graph collectives still waiting for their turn and join the
    sequencer's thread (``shutdown()``, before the communicator closes); it starts again with
    the next one."""
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


def drain_timeline() -> list[tuple[str, int, float, float]]:
    """The collectives the kernels ran since the last drain: ``(label, bytes, start_us, end_us)``."""
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
        label, nbytes, start, end = line.rsplit("\t", 3)
        events.append((label, int(nbytes), float(start), float(end)))
    return events
