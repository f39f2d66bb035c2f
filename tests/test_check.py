"""`sparktrain check`, through the installed command in a subprocess, against real local Spark.

It passes on local[3]; on local-cluster with conf/spark-defaults.conf (the repository's discovery
script, a fake nvidia-smi) it reports the GPUs; it fails with the reason on broken setups.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARKTRAIN = os.path.join(os.path.dirname(sys.executable), "sparktrain")


def check(*args, env=None, timeout=200, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env.pop("PYSPARK_GATEWAY_PORT", None)  # a fresh command, not one started by spark-submit
    return subprocess.run([SPARKTRAIN, "check", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd)


def test_check_passes_on_local_3():
    from importlib.metadata import version

    import pyspark

    proc = check("--master", "local[3]")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert re.search(r"^  master +local\[3\]$", out, re.M), out
    assert re.search(rf"^  Spark version +{re.escape(pyspark.__version__)}$", out, re.M), out
    assert re.search(r"^  task slots +3: ", out, re.M), out
    assert "[ok]   barrier mode: a barrier stage of 3 task(s) ran" in out
    assert "every task reached the driver" in out
    # The driver and each of the 3 tasks report the same versions, none flagged.
    rows = [line.split() for line in out.splitlines() if re.match(r"  (driver|task \d+ at) ", line)]
    assert [r[0] for r in rows] == ["driver", "task", "task", "task"], out
    for r in rows:
        assert r[-2:] == [version("tensorflow"), version("keras")], r
        assert not any(cell.endswith("*") for cell in r), r
    assert re.search(r"^  adlfs +driver: [\d.]+; executors: imports on 3 of 3$", out, re.M), out
    assert re.search(r"^  encryption +auto: runs here are not encrypted; driver: can encrypt; executors: can "
                     r"encrypt on 3 of 3$", out, re.M), out
    # One host: the driver's, with its 3 tasks, each process free to use every CPU of this machine.
    from sparktrain.host.cpus import usable_cpus

    cpus = usable_cpus()
    hosts = [line for line in out.splitlines() if re.match(rf"  (the driver|\S+ \(3 task\(s\)\)) +{cpus} CPU\(s\); ", line)]
    assert len(hosts) == 2, out
    assert len({line.index(f" {cpus} CPU(s)") for line in hosts}) == 1, hosts  # the values in one column
    assert re.search(rf"^  \S+ \(3 task\(s\)\) {cpus} CPU\(s\); ", out, re.M), out  # as wide as the widest label
    assert re.search(r"^  s3fs +driver: [\d.]+; executors: imports on 3 of 3$", out, re.M), out
    assert "[FAIL]" not in out and out.rstrip().endswith("Result: OK, sparktrain.run can launch on this cluster")


def test_check_reports_fake_gpus_on_local_cluster_with_the_shipped_conf(tmp_path):
    """conf/spark-defaults.conf and conf/log4j2.properties as Spark loads them, from SPARK_CONF_DIR."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    with open(os.path.join(ROOT, "conf", "spark-defaults.conf")) as f:
        defaults = f.read()
    assert "/opt/sparktrain/get_gpus_resources.sh" in defaults
    # Installed on "every node" of this one-machine cluster: the repository's own script.
    (conf_dir / "spark-defaults.conf").write_text(
        defaults.replace("/opt/sparktrain/get_gpus_resources.sh", os.path.join(ROOT, "conf", "get_gpus_resources.sh")))
    shutil.copy(os.path.join(ROOT, "conf", "log4j2.properties"), conf_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nprintf '0\\n1\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"SPARK_CONF_DIR": str(conf_dir), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    # Sized for this machine: one core per executor and task, small memory.
    proc = check("--master", "local-cluster[2,1,1024]", "--conf", "spark.executor.cores=1", "--conf",
                 "spark.task.cpus=1", "--conf", "spark.executor.memory=512m", "--conf", "spark.driver.memory=1g",
                 env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    script = os.path.join(ROOT, "conf", "get_gpus_resources.sh")
    assert f"[ok]   GPU scheduling: 1 GPU per task, found by spark.worker.resource.gpu.discoveryScript={script}" in out
    assert re.search(r"^  GPUs per executor +1 \(spark.executor.resource.gpu.amount\), 1 per task: 2 GPU slot\(s\)$",
                     out, re.M), out
    assert "[ok]   GPUs: task 0 got GPU 0, task 1 got GPU 0" in out
    gpu_cells = [line.split()[4] for line in out.splitlines() if re.match(r"  task \d+ at ", line)]
    assert gpu_cells == ["0", "0"], out
    # The quiet log4j2.properties replaced Spark's default profile and its routine warnings.
    assert "log4j2-defaults.properties" not in proc.stderr, proc.stderr
    assert "NativeCodeLoader" not in proc.stderr, proc.stderr


def test_check_fails_with_the_reason_when_gpus_are_asked_for_without_a_discovery_script():
    proc = check("--master", "local-cluster[1,1,1024]", "--conf", "spark.executor.resource.gpu.amount=1",
                 "--conf", "spark.task.resource.gpu.amount=1", "--conf", "spark.executor.memory=512m")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert ("[FAIL] spark.task.resource.gpu.amount=1 asks for a GPU per task, but no GPU discovery script is set "
            "(spark.worker.resource.gpu.discoveryScript is empty)") in out
    assert "(the probing barrier stage is skipped" in out
    assert "Result: 1 problem(s) would make sparktrain.run fail here:" in out


def python_without(module: str, cwd) -> str:
    """The Python this virtual environment was made from, to play executors that run another Python;
    skips the test where it can import ``module``."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    # Away from the checkout, whose sparktrain/ any Python could import from the current directory.
    probe = subprocess.run([base, "-c", f"import {module}"], capture_output=True, timeout=60, cwd=cwd)
    if base == sys.executable or probe.returncode == 0:
        pytest.skip(f"{base} can import {module}, so it cannot play an executor without it")
    return base


@pytest.fixture(scope="module")
def other_python_check(tmp_path_factory):
    """One ``check`` on local[2] whose executors run another Python (the one this virtual environment
    was made from), which lacks sparktrain, and, where it also lacks it, pyarrow."""
    cwd = tmp_path_factory.mktemp("other-python")
    base = python_without("sparktrain", cwd)
    return base, check("--master", "local[2]", env={"PYSPARK_PYTHON": base}, cwd=cwd), cwd


def test_check_fails_when_the_executors_python_lacks_sparktrain(other_python_check):
    base, proc, _ = other_python_check
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "[ok]   barrier mode: a barrier stage of 2 task(s) ran" in out
    assert re.search(r"\[FAIL\] sparktrain is not installed on the executors of task 0 at \S+, task 1 at \S+ "
                     rf"\({re.escape(base)}\); every rank imports it\.", out), out
    sparktrain_cells = [line.split()[6] for line in out.splitlines() if re.match(r"  task \d+ at ", line)]
    assert sparktrain_cells == ["-*", "-*"], out  # flagged in the table too


def test_check_fails_when_spark_refuses_to_start():
    proc = check("--master", "local[1]", "--conf", "spark.task.resource.gpu.amount=1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert ("[FAIL] Spark did not start: org.apache.spark.SparkException: No executor resource configs were "
            "specified for the following task configs: gpu") in proc.stdout


def test_check_fails_when_num_proc_does_not_fit():
    proc = check("--master", "local[2]", "--num-proc", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "[FAIL] num_proc=3 needs 3 task slots at once" in proc.stdout
    assert "Fix: lower num_proc to 2" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--conf", "spark.task.cpus"], "argument --conf: expected KEY=VALUE, got 'spark.task.cpus'"),
    (["--num-proc", "0"], "argument --num-proc: must be a whole number of at least 1, got '0'"),
    (["--wait", "soon"], "argument --wait: must be a positive number of seconds, got 'soon'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_are_refused_before_spark_starts(args, message):
    proc = check(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert "Spark" not in proc.stdout


def test_check_names_the_executors_python_and_each_module_a_task_needs(other_python_check):
    base, proc, cwd = other_python_check
    python_without("pyarrow", cwd)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert re.search(rf"\[FAIL\] the executors' Python {re.escape(base)} cannot import (cloudpickle, )?pyarrow "
                     r"\(task 0 at \S+, task 1 at \S+\), which every rank's task imports", out), out


def test_check_fails_naming_the_executors_whose_keras_is_older_than_the_floor(tmp_path):
    """The executors find Keras 2.15 first (its metadata, ahead of site-packages on their
    PYTHONPATH); the driver has today's. check names them, the version and the fix."""
    info = tmp_path / "keras-2.15.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: keras\nVersion: 2.15.0\n\n")
    proc = check("--master", "local[2]", "--conf", f"spark.executorEnv.PYTHONPATH={tmp_path}")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert re.search(r"\[FAIL\] on the executors of task 0 at \S+, task 1 at \S+, keras 2\.15\.0 is older than 3\.2, "
                     r"the oldest sparktrain supports: pip install 'keras>=3\.2'", out), out
    assert "keras 2.15.0 is older" not in out.split("Versions")[0]  # the driver's own Keras is not below it
