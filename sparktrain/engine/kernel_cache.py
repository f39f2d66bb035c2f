"""Where sparktrain's TensorFlow kernels are cached, and which path a rank on this host will take.

The kernels (``sparktrain.tensorflow.kernels``) are compiled at a rank's first ``init()`` into a
cache directory, named by TensorFlow's version and a hash of what the library is built from: its
sources, the engine's ABI and path, the compiler, and the TensorFlow installation (whose
directory fixes ``tf.sysconfig``'s flags). This module knows all of that without importing
TensorFlow, so ``sparktrain check`` can say on each executor whether its ranks will find the
library cached, compile it (and with what), or fall back to ``tf.numpy_function``, and why.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import stat
import tempfile

from ..settings import rank as rank_settings

#: ``SPARKTRAIN_CACHE_DIR``: where compiled kernels are kept (default ``~/.cache/sparktrain``).
CACHE_ENV = "SPARKTRAIN_CACHE_DIR"
#: ``CXX``: the C++ compiler (default ``g++``).
CXX_ENV = "CXX"
SOURCE = "tf_kernels.cc"
HEADER = "collective.h"
#: Every file the library is built from (compiled: the ``.cc`` ones); all are in its hash.
SOURCES = (SOURCE, "tf_ragged_kernels.cc", "tf_kernel.h", "tf_sequencer.cc", "tf_sequencer.h", "reducer.cc",
           "reducer.h", "engine_op.h", HEADER)
#: A header every TensorFlow kernel includes: its absence means TensorFlow's headers are not installed.
TF_HEADER = os.path.join("tensorflow", "core", "framework", "op_kernel.h")
#: What a rank's collectives run on where the kernels are not loaded.
FALLBACK = "fallback to tf.numpy_function"


def source_dir() -> str | None:
    """Where the kernels' :data:`SOURCES` are: the package's copy (an installed wheel), else the
    source tree's ``native/`` (an editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's directory
    for d in (os.path.join(here, "_native"), os.path.join(os.path.dirname(here), "native")):
        if all(os.path.exists(os.path.join(d, name)) for name in SOURCES):
            return d
    return None


def private_temp_dir(name: str) -> str | None:
    """``<temp dir>/<name>-<uid>``, made 0700 and owned by this user; None where it cannot be (another
    user's, or not a directory): nothing another user can write to is ever used."""
    d = os.path.join(tempfile.gettempdir(), f"{name}-{os.geteuid()}")
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)  # one an older sparktrain made with the umask's mode
    return d


def cache_dir(environ=None) -> str:
    """``$SPARKTRAIN_CACHE_DIR``, else ``~/.cache/sparktrain``, else ``sparktrain-cache-<uid>`` (0700)
    under the temp dir."""
    environ = os.environ if environ is None else environ
    candidates = []
    if environ.get(CACHE_ENV):
        candidates.append(environ[CACHE_ENV])
    home = os.path.expanduser("~")
    if home and home != "~":
        candidates.append(os.path.join(home, ".cache", "sparktrain"))
    for d in candidates:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK | os.X_OK):
            return d
    d = private_temp_dir("sparktrain-cache")
    if d is not None:
        return d
    candidates.append(os.path.join(tempfile.gettempdir(), f"sparktrain-cache-{os.geteuid()}"))
    raise OSError(f"no writable cache directory among {', '.join(candidates)} (the last must be this user's "
                  f"own); set {CACHE_ENV}")


@functools.lru_cache(maxsize=None)
def tensorflow_install() -> tuple[str, str] | None:
    """``(version, package directory)`` of the TensorFlow installed here, found without importing it."""
    from importlib import metadata, util

    try:
        spec = util.find_spec("tensorflow")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    where = os.path.realpath(list(spec.submodule_search_locations)[0])
    for dist in metadata.packages_distributions().get("tensorflow", []):
        try:
            return metadata.version(dist), where
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    """What this host's ranks would build, with what, and where the library goes."""

    engine: str  #: the engine library's path
    src: str  #: the sources' directory
    cxx: str  #: the compiler, as $CXX names it
    tf_version: str
    tf_dir: str  #: TensorFlow's package directory
    directory: str  #: the cache's ``tf_kernels`` directory
    library: str  #: the cached library's path


def target(environ=None) -> Target:
    """This host's :class:`Target`; OSError saying why the kernels cannot be built or found here."""
    from .. import engine as _engine  # this package, whose __init__ loads the engine

    environ = os.environ if environ is None else environ
    engine = _engine._library_path()
    if engine is None or not _engine.available():
        raise OSError(f"no native engine ({_engine.unavailable_reason() or 'not built'})")
    engine = os.path.abspath(engine)
    src = source_dir()
    if src is None:
        raise OSError(f"the kernels' source ({SOURCE}) is not in this installation of sparktrain")
    tf = tensorflow_install()
    if tf is None:
        raise OSError("TensorFlow is not installed")
    cxx = environ.get(CXX_ENV) or "g++"
    directory = os.path.join(cache_dir(environ), "tf_kernels")
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(src, name), "rb") as f:
            h.update(f.read())
    for part in (str(_engine._ABI_VERSION), os.path.realpath(engine), cxx, *tf):
        h.update(b"\0" + part.encode())
    library = os.path.join(directory, f"tf_kernels-tf{tf[0]}-{h.hexdigest()[:16]}.so")
    return Target(engine, src, cxx, tf[0], tf[1], directory, library)


def missing_tools(t: Target) -> str | None:
    """Why ``t`` cannot be compiled here (no TensorFlow headers, no compiler), or None when it can."""
    include = os.path.join(t.tf_dir, "include")
    if not os.path.exists(os.path.join(include, TF_HEADER)):
        return f"no TensorFlow headers ({os.path.join(include, TF_HEADER)} is missing)"
    if shutil.which(t.cxx) is None:
        return f"no C++ compiler: {t.cxx!r} is not on PATH"
    return None


def plan(environ=None) -> dict:
    """What a rank's ``init()`` on this host will do about the kernels, without doing it:
    ``{"path": "cached" | "compile" | "fallback" | "ring" | "none", "why": ..., "compiler": ...,
    "cache": the cache's tf_kernels directory, "library": the library's path}``."""
    environ = os.environ if environ is None else environ
    found = {"path": "fallback", "why": None, "compiler": None, "cache": None, "library": None}
    if not rank_settings.parse(environ).tf_kernels:
        return {**found, "why": "turned off by SPARKTRAIN_TF_KERNELS=0"}
    try:
        t = target(environ)
    except OSError as e:
        why = str(e)
        if why.startswith("no native engine"):
            return {**found, "path": "ring", "why": why}
        if why.startswith("TensorFlow is not installed"):
            return {**found, "path": "none", "why": why}
        return {**found, "why": why}
    found.update(cache=t.directory, library=t.library)
    if os.path.exists(t.library):
        return {**found, "path": "cached"}
    why = missing_tools(t)
    if why is not None:
        return {**found, "why": why}
    return {**found, "path": "compile", "compiler": shutil.which(t.cxx)}


def describe(p: dict) -> str:
    """One line for :func:`plan`'s answer."""
    if p["path"] == "cached":
        return f"kernels cached ({p['library']})"
    if p["path"] == "compile":
        return f"will compile with {p['compiler']} at the first init() into {p['cache']}"
    if p["path"] == "ring":
        return f"TensorFlow's ring, no kernels: {p['why']}"
    if p["path"] == "none":
        return f"no kernels: {p['why']}"
    return f"{FALLBACK}: {p['why']}" + (f" (cache {p['cache']})" if p["cache"] else "")
