"""A newcomer's script builds its own SparkSession without PYSPARK_PYTHON and is started with the
venv's interpreter, unactivated: the executors would run ``python3`` from PATH, which lacks
sparktrain. The run is refused before any Spark job, naming both interpreters and the fix, and the
fix it names works."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from connect_server import needs_server

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

SCRIPT = """
import os, sys, time
from pyspark.sql import SparkSession
import sparktrain


def session():
    builder = SparkSession.builder.master(sys.argv[1]).config("spark.ui.enabled", "false")
    if sys.argv[1].startswith("local-cluster"):
        builder = builder.config("spark.executor.memory", "512m")
    return builder.getOrCreate()


def attempt(spark):
    started = time.monotonic()
    try:
        print("RESULT", sparktrain.run(lambda: sparktrain.size(), num_proc=2, verbose=0))
    except sparktrain.SparkTrainError as e:
        print(f"ERROR {type(e).__name__} after {time.monotonic() - started:.2f} s: {e}")
    print("JOBS", spark.sparkContext._jsc.sc().statusStore().jobsList(None).size())


spark = session()
attempt(spark)
if sys.argv[2] == "then-fixed":
    # The fix the error names, in a new session of the same script.
    spark.stop()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    print("FIXED")
    attempt(session())
"""


def newcomer(tmp_path, master: str, how: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    return subprocess.run([sys.executable, "train.py", master, how], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)


@pytest.fixture(scope="module")
def path_python():
    probe = subprocess.run(["python3", "-c", "import sparktrain, cloudpickle, pyarrow"], capture_output=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=60)
    if probe.returncode == 0:
        pytest.skip("python3 on PATH has sparktrain, so it cannot play an executor without it")


@pytest.mark.parametrize("master, then", [("local[2]", "then-fixed"), ("local-cluster[2,1,1024]", "as-is")])
def test_executors_without_sparktrain_are_refused_before_launch_naming_both_pythons(path_python, tmp_path, master,
                                                                                     then):
    proc = newcomer(tmp_path, master, then)
    out = proc.stdout.split("FIXED")[0]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR ClusterConfigError" in out, out + proc.stderr[-3000:]
    assert "the executors' Python, python3 (" in out and "cannot import sparktrain" in out, out
    assert f"this driver runs {sys.executable}" in out, out
    assert f"export PYSPARK_PYTHON={sys.executable}" in out, out
    assert "JOBS 0" in out, out  # refused before any Spark job
    if then == "then-fixed":
        # The fix the error names makes the run work: its one job is the run's stage.
        fixed = proc.stdout.split("FIXED", 1)[1]
        assert "RESULT 2" in fixed and "JOBS 1" in fixed, proc.stdout + proc.stderr[-3000:]


CONNECT_SCRIPT = """
import sys, time
from pyspark.sql import SparkSession
import sparktrain

spark = SparkSession.builder.remote("local[2]").getOrCreate()  # the embedded Connect server
started = time.monotonic()
try:
    print("RESULT", sparktrain.run(lambda: sparktrain.size(), num_proc=2, verbose=0))
except sparktrain.SparkTrainError as e:
    print(f"ERROR {type(e).__name__} after {time.monotonic() - started:.2f} s: {e}")
"""


@needs_server
def test_over_connect_executors_without_the_clients_python_are_refused_before_launch(path_python, tmp_path):
    # The same newcomer over Spark Connect: the client cannot run the server's executors' Python,
    # so the probe job that chooses the rendezvous reports it (here it cannot even start an Arrow task).
    (tmp_path / "train.py").write_text(CONNECT_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "SPARK_REMOTE",
                        "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_CONNECT_AUTHENTICATE_TOKEN")}
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=200)
    out = proc.stdout
    assert "ERROR ClusterConfigError" in out, out + proc.stderr[-3000:]
    assert "the executors' Python" in out and ("No module named" in out or "cannot import" in out), out
    assert f"this client runs {sys.executable}" in out, out
    assert f"export PYSPARK_PYTHON={sys.executable}" in out, out
