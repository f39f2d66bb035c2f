"""The engine built with AddressSanitizer and UndefinedBehaviorSanitizer runs the correctness
cases (tests/native_sanitized.py) with no report. Cheap enough for CI: one build, a few seconds."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests")

pytestmark = pytest.mark.timeout(240)


def _runtime(cc: str, name: str) -> str | None:
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def sanitized_library(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    asan = _runtime(cc, "libasan.so")
    if asan is None:
        pytest.skip("this compiler has no AddressSanitizer runtime")
    out = str(tmp_path_factory.mktemp("asan") / "libcollective_asan.so")
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
    subprocess.run([cc, "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=undefined", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                    "-pthread", "-I", os.path.join(ROOT, "native"), *sources, "-o", out, "-lrt"],
                   check=True, capture_output=True, text=True, timeout=120)
    return out, asan


def test_the_engine_compiles_with_warnings_as_errors(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
    proc = subprocess.run([cc, "-std=c11", "-O3", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror", "-fPIC",
                           "-shared", "-pthread", *sources, "-o", str(tmp_path / "lib.so")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_correctness_under_asan_and_ubsan(sanitized_library):
    library, asan = sanitized_library
    env = dict(os.environ, LD_PRELOAD=asan, SPARKTRAIN_NATIVE_LIBRARY=library,
               # Python's own allocations are not the engine's leaks; any report fails the rank.
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=99",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=98",
               PYTHONPATH=os.pathsep.join([HERE, ROOT]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "native_sanitized.py")], env=env, capture_output=True,
                          text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Sanitizer" not in output and "runtime error" not in output, output[-6000:]
