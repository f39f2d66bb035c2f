"""Local mode: N processes on the driver, same contract, supervision and result path, no Spark."""
from __future__ import annotations

import io
import json

import pytest

import sparktrain
from helpers import rank_processes, read_ranks, record_rank, run_marker, wait_pids_gone

pytestmark = pytest.mark.timeout(120)


def train(outdir, scale):
    import sparktrain

    info = record_rank(outdir)
    print(f"rank {info['rank']} says hi")
    return scale * 10 if sparktrain.rank() == 0 else None


@pytest.mark.parametrize("how", [{"num_proc": -3}, {"num_proc": 3, "local_mode": True}])
def test_local_mode_runs_ranks_without_spark(tmp_path, how):
    from pyspark import SparkContext

    out = io.StringIO()
    assert sparktrain.run(train, args=(str(tmp_path), 4), stdout=out, **how) == 40
    assert SparkContext._active_spark_context is None  # no Spark was started
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    assert [ranks[r]["env"]["SPARKTRAIN_LOCAL_RANK"] for r in range(3)] == ["0", "1", "2"]
    assert {ranks[r]["env"]["MASTER_ADDR"] for r in range(3)} == {"127.0.0.1"}
    assert {ranks[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(3)} == {"-1"}
    assert len({json.loads(ranks[r]["env"]["TF_CONFIG"])["cluster"]["worker"][r] for r in range(3)}) == 3
    assert sorted(out.getvalue().splitlines()) == [f"[{r}]<stdout>:rank {r} says hi" for r in range(3)]
    assert wait_pids_gone([r["pid"] for r in ranks.values()], timeout=5) == []


def boom(outdir):
    import sparktrain

    record_rank(outdir)
    if sparktrain.rank() == 1:
        raise RuntimeError("local failure")
    import time

    time.sleep(120)  # a long training step; must be cut short when rank 1 fails


def test_local_mode_failure_stops_every_rank(tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(boom, args=(str(tmp_path),), num_proc=-3, verbose=0, stderr=io.StringIO())
    assert e.value.root_cause.rank == 1 and e.value.root_cause.message == "local failure"
    ranks = read_ranks(str(tmp_path))
    assert wait_pids_gone([r["pid"] for r in ranks.values()], timeout=10) == []
    assert rank_processes(run_marker(ranks[1])) == []  # rank 1 always got to record itself


def test_local_mode_gpu_needs_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(sparktrain.InsufficientResourcesError, match="needs 2 GPUs.*shows 1"):
        sparktrain.run(train, args=("/nonexistent", 1), num_proc=-2, use_gpu=True)


def test_import_sparktrain_without_tensorflow_or_pyspark():
    """`import sparktrain` and the worker API work where tensorflow (and pyspark) cannot be imported."""
    import subprocess
    import sys

    code = r"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("tensorflow", "keras", "tf_keras", "pyspark", "torch", "jax", "jaxlib"):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
import sparktrain, sparktrain.executor.child, sparktrain.executor.task, sparktrain.driver.run, sparktrain.jax
import sparktrain.data
assert callable(sparktrain.rank) and callable(sparktrain.attempt)  # no subpackage shadows the worker API
assert sparktrain.run is sparktrain.driver.run.run
assert not any(m.split(".")[0] in ("tensorflow", "keras", "pyspark", "jax") for m in sys.modules)
print("ok", sparktrain.size())
"""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok 1"


def import_tensorflow():
    import tensorflow as tf

    print("imported", tf.__version__.split(".")[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, verbose, shown", [({}, 1, False), ({}, 2, True), ({"TF_CPP_MIN_LOG_LEVEL": "0"}, 1, True)])
def test_tensorflow_start_up_lines_are_hidden_unless_asked_for(env, verbose, shown, monkeypatch):
    # The ranks inherit this process's environment: a TF_CPP_MIN_LOG_LEVEL left by another test's
    # import (jax sets it to 1 in the process that imports it) would be the user's own setting.
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    out, err = io.StringIO(), io.StringIO()
    sparktrain.run(import_tensorflow, num_proc=-1, env=env, verbose=verbose, stdout=out, stderr=err)
    assert "[0]<stdout>:imported 2" in out.getvalue()
    startup = [line for line in err.getvalue().splitlines() if "oneDNN custom operations" in line
               or "absl::InitializeLog" in line]
    assert bool(startup) == shown, err.getvalue()[-2000:]


def leave_things_to_the_exit(outdir: str):
    """Leaves what only the interpreter's shutdown finishes: a file left open and unflushed in a
    module's global, cyclic garbage whose finalizer writes, and an exit hook."""
    import atexit
    import os
    import sys

    class Finalized:
        def __init__(self):
            self.me = self  # a cycle: only the garbage collector frees it

        def __del__(self):
            with open(os.path.join(outdir, "finalized"), "w") as f:
                f.write("ran")

    Finalized()
    sys.modules["__main__"].left_open = open(os.path.join(outdir, "left-open"), "w")
    sys.modules["__main__"].left_open.write("flushed at exit")
    atexit.register(lambda: open(os.path.join(outdir, "atexit"), "w").write("ran"))
    return os.getpid()


def test_a_rank_still_flushes_finalizes_and_runs_exit_hooks_as_it_leaves(tmp_path):
    pid = sparktrain.run(leave_things_to_the_exit, args=(str(tmp_path),), num_proc=-1, verbose=0)
    assert wait_pids_gone([pid], timeout=10) == []
    assert (tmp_path / "left-open").read_text() == "flushed at exit"
    assert (tmp_path / "finalized").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran"


def gc_threshold():
    import gc

    return gc.get_threshold()


@pytest.mark.parametrize("env, expected", [({}, (700, 10, 100)),
                                           ({"SPARKTRAIN_GC_THRESHOLD": "python"}, (700, 10, 10)),
                                           ({"SPARKTRAIN_GC_THRESHOLD": " 2000, 5, 50"}, (2000, 5, 50))])
def test_a_rank_runs_train_fn_under_the_gc_threshold_setting(env, expected):
    assert sparktrain.run(gc_threshold, num_proc=-1, env=env, verbose=0) == expected


def test_the_gc_threshold_in_the_spark_conf_reaches_the_rank_in_its_canonical_form():
    from helpers import handed_env

    assert handed_env({}, {"spark.sparktrain.gcThreshold": " 2000 ,5,50"}) == {
        "SPARKTRAIN_GC_THRESHOLD": "2000,5,50", "SPARKTRAIN_ENCRYPTION": "off"}
    assert handed_env({"SPARKTRAIN_GC_THRESHOLD": "python"}, {"spark.sparktrain.gcThreshold": "1,1,1"}) == {
        "SPARKTRAIN_GC_THRESHOLD": "python", "SPARKTRAIN_ENCRYPTION": "off"}


@pytest.mark.parametrize("value", ["700,10", "0,10,10", "a,b,c", "700,-1,10"])
def test_a_bad_gc_threshold_is_refused_before_any_rank_starts(value):
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"SPARKTRAIN_GC_THRESHOLD.*'python'") as e:
        sparktrain.run(gc_threshold, num_proc=-1, env={"SPARKTRAIN_GC_THRESHOLD": value}, verbose=0)
    assert repr(value) in str(e.value)


def legacy_keras_in_rank():
    import os

    import sparktrain.kerasline as kerasline

    return os.environ.get("TF_USE_LEGACY_KERAS"), kerasline.served()


@pytest.mark.parametrize("driver, env, expected", [
    ("1", {}, ("1", "tf_keras")),                                 # the driver's own variable reaches the ranks
    (None, {"TF_USE_LEGACY_KERAS": "True"}, ("1", "tf_keras")),   # env=, in the form TensorFlow reads
    ("1", {"TF_USE_LEGACY_KERAS": "false"}, ("0", "keras")),      # env= wins over the driver's
    (None, {}, (None, "keras"))])
def test_the_legacy_keras_setting_reaches_every_rank(monkeypatch, driver, env, expected):
    if driver is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", driver)
    assert sparktrain.run(legacy_keras_in_rank, num_proc=-1, env=env, verbose=0) == expected


@pytest.mark.parametrize("value", ["yes", "on", "TRUE", "maybe"])
@pytest.mark.parametrize("where", ["env", "driver"])
def test_a_legacy_keras_value_tensorflow_reads_otherwise_is_refused_before_any_rank_starts(monkeypatch, value, where):
    """TensorFlow reads only 1, true and True as tf_keras: with yes, on or TRUE this driver's tf.keras
    is Keras 3, so a run that gave its ranks tf_keras would train on two lines. Refused, naming the values."""
    if where == "driver":
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    with pytest.raises(sparktrain.InvalidArgumentError,
                       match=rf"TF_USE_LEGACY_KERAS='{value}': TensorFlow reads only 1, true, True as tf_keras"):
        sparktrain.run(legacy_keras_in_rank, num_proc=-1, env={"TF_USE_LEGACY_KERAS": value} if where == "env" else {},
                       verbose=0)


@pytest.mark.parametrize("env, words", [({"SPARKTRAIN_COLLECTIVE_TIMEOUT": "abc"}, "SPARKTRAIN_COLLECTIVE_TIMEOUT"),
                                        ({"SPARKTRAIN_CPU_TRANSPORT": "pigeon"}, "SPARKTRAIN_CPU_TRANSPORT")])
def test_a_bad_value_of_a_setting_read_in_the_rank_is_refused_before_any_rank_starts(env, words):
    from sparktrain import settings

    # Every setting the ranks read is parsed on the driver first: the table says which they are.
    assert {"collective_timeout", "cpu_transport", "legacy_keras"} <= set(settings.READ_IN_RANK)
    with pytest.raises(sparktrain.InvalidArgumentError, match=words) as e:
        sparktrain.run(gc_threshold, num_proc=-2, env=env, verbose=0)
    assert repr(next(iter(env.values()))) in str(e.value)
