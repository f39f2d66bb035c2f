"""Shared fixtures: real Spark sessions (one per test module) and process bookkeeping."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _quiet_spark(builder):
    return (builder.config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={HERE}/log4j2-test.properties"))


def make_spark(master: str, **conf):
    """A real SparkSession whose workers run this interpreter and can import tests/helpers.py."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])
    from pyspark.sql import SparkSession

    builder = _quiet_spark(SparkSession.builder.master(master).appName("sparktrain-tests"))
    for k, v in conf.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


@pytest.fixture(scope="module")
def spark():
    """One local[3] session per test module."""
    session = make_spark("local[3]")
    yield session
    session.stop()


@pytest.fixture(autouse=True, scope="module")
def _pickle_test_module_by_value(request):
    """Train functions defined in a test module travel by value, as a notebook's do."""
    import cloudpickle

    module = request.module
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


def pytest_configure(config):
    config.addinivalue_line("markers", "spark: needs a real Spark session")
