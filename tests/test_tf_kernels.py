"""Building and loading sparktrain's TensorFlow kernels (``sparktrain.tensorflow.kernels``): one
compile per cache directory however many processes ask at once, the fallback with one warning
where there is no compiler, no temporary files left behind, and a clean error from a kernel run
with no engine. Real processes and the real compiler; the collectives themselves are tested
through the kernels in test_hvd_collectives.py (with hvd_gradient_ranks.py)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from sparktrain import engine

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]

BUILD = """
import sys
from sparktrain.tensorflow import kernels
print("PATH", kernels.build(), flush=True)
"""

LOAD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import tensorflow as tf
from sparktrain.tensorflow import kernels
print("FIRST", kernels.load() is not None, flush=True)
print("SECOND", kernels.load() is not None, flush=True)
print("WHY", kernels.failure(), flush=True)
if kernels.ops() is not None:
    try:
        kernels.ops().sparktrain_allreduce(tf.zeros([2]), reduce_op=0)
    except tf.errors.FailedPreconditionError as e:
        print("NOCOMM", e.message, flush=True)
"""


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "SPARKTRAIN_TF_KERNELS")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update({"SPARKTRAIN_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp"),
                "TF_CPP_MIN_LOG_LEVEL": "2", **extra})
    return env


def _python(code: str, env: dict):
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _lines(out: str, tag: str) -> list[str]:
    return [line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " ")]


@pytest.mark.slow  # a fresh cache compiles: it runs in the wheel tier, from the wheel's sources
def test_concurrent_processes_of_two_hosts_compile_once_into_a_shared_cache_and_load_it(tmp_path):
    """Three ranks of two simulated hosts (a temp dir each) share one SPARKTRAIN_CACHE_DIR: one
    compile, in its host's temp dir, published into the cache by a rename."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"  # counts the compiles and where each writes, then compiles
    wrapper.write_text(f"#!/bin/sh\nfor a; do [ \"$prev\" = -o ] && echo \"$a\" >> {log}; prev=$a; done\n"
                       f"exec {cxx} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    for h in hosts:
        h.mkdir()
    env = _env(tmp_path, CXX=str(wrapper))
    procs = [_python(BUILD, {**env, "TMPDIR": str(h)}) for h in (hosts[0], hosts[0], hosts[1])]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    paths = {_lines(o[0], "PATH")[0] for o in outs}
    assert len(paths) == 1, paths
    path = paths.pop()
    assert os.path.dirname(path) == str(tmp_path / "cache" / "tf_kernels") and os.path.exists(path)
    compiles = log.read_text().split()
    assert len(compiles) == 1, compiles  # one compile for three processes
    assert any(compiles[0].startswith(str(h) + os.sep) for h in hosts), compiles  # in a host's temp dir
    assert sorted(os.listdir(tmp_path / "cache" / "tf_kernels")) == sorted([os.path.basename(path), "tf_kernels.lock"])
    assert [os.listdir(h) for h in hosts] == [[], []]

    # A later process loads the cached library (no compile), and a kernel run with no engine
    # running says to call init().
    p = _python(LOAD, env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert _lines(out, "FIRST") == ["True"] and _lines(out, "SECOND") == ["True"], err[-2000:]
    assert len(log.read_text().split()) == 1
    assert "init()" in _lines(out, "NOCOMM")[0]


@pytest.mark.parametrize("cxx", ["/nonexistent/g++", "false"])
def test_without_a_working_compiler_the_fallback_says_why_once_and_leaves_no_files(tmp_path, cxx):
    env = _env(tmp_path, CXX=cxx)
    p = _python(LOAD, env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert _lines(out, "FIRST") == ["False"] and _lines(out, "SECOND") == ["False"]
    warnings = [line for line in err.splitlines() if "TensorFlow kernels" in line]
    assert len(warnings) == 1, err[-2000:]
    assert "g++" in warnings[0] and "numpy_function" in warnings[0]
    assert cxx in _lines(out, "WHY")[0]
    kept = tmp_path / "cache" / "tf_kernels"
    left = os.listdir(kept) if os.path.exists(kept) else []
    assert left in ([], ["tf_kernels.lock"]), left  # no library, no partial file
    assert os.listdir(tmp_path / "tmp") == []


def test_turned_off_by_the_setting_without_a_warning(tmp_path):
    p = _python(LOAD, _env(tmp_path, SPARKTRAIN_TF_KERNELS="0"))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert _lines(out, "FIRST") == ["False"] and "SPARKTRAIN_TF_KERNELS=0" in _lines(out, "WHY")[0]
    assert "TensorFlow kernels" not in err
    assert not os.path.exists(tmp_path / "cache")


def fault_inside_a_function(outdir, fault, where="function"):
    """Rank 0 runs an allreduce inside a tf.function (or a TensorFlow 1 graph's session, where
    the kernels' sequencer runs it) while rank 1 never calls (``timeout``) or exits (``dead``);
    rank 0 records the error TensorFlow raised."""
    import time

    import tensorflow as tf

    import sparktrain
    import sparktrain.tensorflow as hvd
    from helpers import record_rank

    def all_here(name: str) -> None:
        """The ranks meet here (a file each), so that a short timeout times the fault alone, not
        how far apart a loaded machine started them."""
        open(os.path.join(outdir, f"{name}-{sparktrain.rank()}"), "w").close()
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(outdir, f"{name}-{r}")) for r in range(2)):
            assert time.monotonic() < deadline, f"the other rank never reached {name}"
            time.sleep(0.01)

    all_here("init")
    hvd.init()
    if where == "function":
        step = tf.function(lambda: hvd.allreduce(tf.ones([4]), op=hvd.Sum))
    else:
        graph = tf.Graph()
        with graph.as_default():
            op = hvd.allreduce(tf.ones([4]), op=hvd.Sum)
        sess = tf.compat.v1.Session(graph=graph)

        def step():
            return tf.constant(sess.run(op))
    all_here("warmup")
    got = {"kernels": hvd.collective_kernels(), "warmup": step().numpy().tolist()}
    done = os.path.join(outdir, "rank-0-has-its-error")
    if hvd.rank() == 1:
        if fault == "dead":
            os._exit(0)  # mid-run, without shutting down: rank 0 is left waiting for it
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:  # never calls: rank 0 times out
            time.sleep(0.05)
    else:
        start = time.monotonic()
        try:
            step()
            got["error"] = "no error"
        except tf.errors.OpError as e:
            got["error"] = f"{type(e).__name__}: {e.message}"
        got["seconds"] = time.monotonic() - start
        open(done, "w").close()
    record_rank(outdir, got=got)


@pytest.mark.parametrize("where", ["function", "graph"])
@pytest.mark.parametrize("fault,error,timeout", [("timeout", "DeadlineExceededError", "3"),
                                                 ("dead", "UnavailableError", "60")])
def test_inside_a_function_a_timeout_and_a_dead_peer_are_tensorflows_errors(tmp_path, fault, error, timeout, where):
    """A peer that never calls ends the collective at the timeout; a dead one ends it well before
    (the 60 s timeout also leaves a loaded machine time to attach). In a TensorFlow 1 graph the
    same classes, from the sequencer's round."""
    import sparktrain
    from helpers import read_ranks

    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": timeout}
    sparktrain.run(fault_inside_a_function, args=(str(tmp_path), fault, where), num_proc=-2, env=env, verbose=0)
    got = read_ranks(str(tmp_path))[0]["got"]
    assert got["kernels"] is True and got["warmup"] == [2.0] * 4
    assert got["error"].startswith(error + ": ") and "rank 1" in got["error"], got
