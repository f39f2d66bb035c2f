"""``sparktrain check`` reports which engine each executor's CPU collectives run on, and which
path its ranks take for the TensorFlow kernels (cached, compiled at the first init(), or the
tf.numpy_function fallback) and why; ``--build`` compiles them into the cache ahead of a run."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from sparktrain import engine

SPARKTRAIN = os.path.join(os.path.dirname(sys.executable), "sparktrain")

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]


def _check(*args, **env) -> str:
    env = {**os.environ, **env}
    env.pop("PYSPARK_GATEWAY_PORT", None)
    proc = subprocess.run([SPARKTRAIN, "check", "--master", "local[2]", *args], capture_output=True, text=True,
                          timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_check_names_the_cpu_engine_and_the_kernels_fallback_of_every_executor(tmp_path):
    """No compiler (CXX names none) and an empty cache: the kernels' fallback, and why."""
    cache = tmp_path / "cache"
    out = _check(CXX="/nonexistent/g++", SPARKTRAIN_CACHE_DIR=str(cache))
    assert re.search(r"^  engine +driver: native; executors: native on 2 of 2$", out, re.M), out
    why = re.escape(f"fallback to tf.numpy_function: no C++ compiler: '/nonexistent/g++' is not on PATH "
                    f"(cache {cache / 'tf_kernels'})")
    assert re.search(rf"^  the driver +{why}$", out, re.M), out
    assert re.search(rf"^  \S+ \(2 task\(s\)\) +{why}$", out, re.M), out
    assert re.search(r"^  \[WARN\] task 0 at \S+, task 1 at \S+: collectives inside tf.function run through "
                     r"tf.numpy_function \(no C\+\+ compiler", out, re.M), out
    assert not os.path.exists(cache / "tf_kernels") or os.listdir(cache / "tf_kernels") == []


@pytest.mark.slow
def test_check_build_compiles_the_kernels_once_into_the_cache(tmp_path):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"  # counts the compiles, then compiles
    wrapper.write_text(f"#!/bin/sh\necho $$ >> {log}\nexec {cxx} \"$@\"\n")
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    out = _check("--build", CXX=str(wrapper), SPARKTRAIN_CACHE_DIR=str(cache))
    assert len(log.read_text().split()) == 1, out  # one compile for the host's 2 tasks
    libraries = [n for n in os.listdir(cache / "tf_kernels") if n.endswith(".so")]
    assert len(libraries) == 1 and not [n for n in os.listdir(cache / "tf_kernels") if n.endswith(".tmp")]
    assert re.search(rf"^  \[ok\]   executor host \S+: compiled into {re.escape(str(cache / 'tf_kernels'))} "
                     r"\([\d.]+ s\)$", out, re.M), out
    cached = re.escape(f"kernels cached ({cache / 'tf_kernels' / libraries[0]})")
    assert re.search(rf"^  the driver +{cached}$", out, re.M), out
    assert re.search(rf"^  \S+ \(2 task\(s\)\) +{cached}$", out, re.M), out
