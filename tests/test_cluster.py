"""The driver's pure helpers: kinds of master, expected executors, Spark's error text; local files
written whole or not at all. No Spark."""
from __future__ import annotations

import os

import pytest

from sparktrain.host import localfiles
from sparktrain import settings
from sparktrain.driver.launch import cluster
from sparktrain.driver.show import spark_errors
from sparktrain.errors import InvalidArgumentError


@pytest.mark.parametrize("master, local, here", [
    ("local", True, True), ("local[3]", True, True), ("local[*]", True, True), ("local[2,3]", True, True),
    ("local-cluster[2,1,1024]", False, True), ("spark://host:7077", False, False), ("yarn", False, False),
    ("localhost:7077", False, False),
])
def test_kinds_of_master(master, local, here):
    assert (cluster.is_local(master), cluster.on_this_host(master)) == (local, here)


@pytest.mark.parametrize("master, conf, expected", [
    ("local[4]", {}, 1), ("local-cluster[3,1,1024]", {}, 3), ("yarn", {"spark.executor.instances": "4"}, 4),
    ("yarn", {}, None),
])
def test_expected_executors(master, conf, expected):
    assert cluster.expected_executors(master, conf) == expected


def test_spark_error_reason_leads_with_the_stage_failure_and_the_python_cause():
    text = ("An error occurred while calling o81.collectToPython.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: barrier task ResultTask(0, 1) "
            "finished unsuccessfully.\n"
            "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
            '  File "worker.py", line 1, in main\n'
            "ModuleNotFoundError: No module named 'pyarrow'\n"
            "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n")
    reason = spark_errors.spark_error_reason(RuntimeError(text))
    assert reason.startswith("barrier task ResultTask(0, 1) finished unsuccessfully."), reason
    assert reason.endswith("ModuleNotFoundError: No module named 'pyarrow'"), reason
    assert "at org.apache" not in reason and "An error occurred" not in reason


def test_spark_error_reason_of_a_one_line_error():
    assert spark_errors.spark_error_reason(ValueError("bad master URL")) == "bad master URL"


def test_the_collective_timeout_is_a_setting_whose_errors_name_the_variable():
    environ = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "soon"}
    with pytest.raises(InvalidArgumentError, match="SPARKTRAIN_COLLECTIVE_TIMEOUT must be a positive number of "
                                                   "seconds, got 'soon'"):
        settings.resolve("collective_timeout", None, environ=environ)
    assert settings.resolve("collective_timeout", None, environ={"SPARKTRAIN_COLLECTIVE_TIMEOUT": "30"}) == 30.0
    assert settings.resolve("collective_timeout", 5, environ=environ) == 5.0


def test_a_file_replaced_atomically_is_whole_or_untouched(tmp_path):
    path = str(tmp_path / "model.keras")
    localfiles.write_atomically(path, b"first", durable=True)
    with pytest.raises(RuntimeError):
        with localfiles.replaced_atomically(path) as tmp:
            assert tmp.endswith(".keras") and os.path.dirname(tmp) == str(tmp_path)
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("the writer died")
    assert open(path, "rb").read() == b"first"
    assert os.listdir(tmp_path) == ["model.keras"]  # no temporary file left behind
    localfiles.write_atomically(path, b"second")
    assert open(path, "rb").read() == b"second" and os.listdir(tmp_path) == ["model.keras"]
