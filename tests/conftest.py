"""Shared test set-up: real Spark sessions (each module starts and stops its own), the JVMs' temp
dir, and pickling."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

#: Fixtures that start real storage servers (azurite, moto_s3), and the multi-host tier's cluster.
pytest_plugins = ["storage_servers", "multihost_cluster"]


#: The suite's JVMs (drivers, executors, standalone daemons, the Connect server) live for seconds
#: to minutes: the client compiler alone and the serial collector start them with about a third
#: less CPU, which on a 2-core machine is a third less wait for every Spark session.
JVM_QUICK_START = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

QUIET = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
}


def make_spark(master: str, **conf):
    """A real SparkSession whose workers run this interpreter and can import tests/helpers.py.

    Built from its own SparkConf, not SparkSession.builder: the builder's options are shared
    by every builder in the process, so one module's settings (fake GPUs, say) would leak
    into the next module's session.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    settings = {**QUIET, **jvm_conf(), **conf}
    spark_conf = SparkConf(loadDefaults=False).setMaster(master).setAppName("sparktrain-tests")
    spark_conf.setAll(list(settings.items()))
    session = SparkSession(SparkContext(conf=spark_conf))
    session._test_settings = list(settings)
    if master.startswith("local-cluster["):
        _wait_for_executors(session, settings)
    return session


def _wait_for_executors(session, settings, timeout: float = 120.0) -> None:
    """Every executor of a local-cluster has registered: its JVMs start after the session does,
    and slowly on a loaded machine. Tests then never race executor start-up."""
    from sparktrain.driver import cluster

    conf = dict(settings)
    expected = cluster.expected_executors(session.sparkContext.master, conf)
    cap = cluster.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= expected, timeout)
    if cap.executors < expected:
        raise TimeoutError(f"only {cap.executors} of {expected} executors registered within {timeout:g} s")


def stop_spark(session) -> None:
    """Stop ``session`` and forget its settings, which Spark also left in JVM system properties."""
    from pyspark import SparkContext

    jvm = SparkContext._jvm
    session.stop()
    for key in getattr(session, "_test_settings", []):
        jvm.System.clearProperty(key)


def module_spark(master: str, **conf):
    """A module-scoped fixture: one real SparkSession shared by every test of the module."""

    @pytest.fixture(scope="module")
    def spark():
        session = make_spark(master, **conf)
        yield session
        stop_spark(session)

    return spark


@pytest.fixture(autouse=True, scope="module")
def _pickle_test_module_by_value(request):
    """Train functions defined in a test module travel by value, as a notebook's do."""
    import cloudpickle

    module = request.module
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


#: The temp dir (java.io.tmpdir) of every JVM this test process starts, removed when the process is
#: done: a JVM leaves the native library it unpacked (liblz4-java-*.so and its .lck) behind, at
#: every exit for the driver's gateway and whenever a test or a worker kills an executor.
_jvm_tmp: str | None = None


def jvm_options() -> str:
    """The options of every JVM this test process starts: a quick start and the process's temp dir."""
    return f"{JVM_QUICK_START} -Djava.io.tmpdir={_jvm_tmp}" if _jvm_tmp else JVM_QUICK_START


def jvm_conf() -> dict[str, str]:
    """A Spark application's JVM options: :func:`jvm_options`, and the test log settings for its driver."""
    log = f"-Dlog4j2.configurationFile={HERE}/log4j2-test.properties"
    return {"spark.driver.extraJavaOptions": f"{jvm_options()} {log}", "spark.executor.extraJavaOptions": jvm_options()}


def pytest_configure(config):
    global _jvm_tmp
    _jvm_tmp = tempfile.mkdtemp(prefix="sparktrain-tests-jvm-")
    # Every JVM the suite starts through spark-submit (pyspark's gateway, the Connect server) or
    # spark-class (standalone master and workers) starts quickly too, with that temp dir.
    os.environ.setdefault("SPARK_SUBMIT_OPTS", jvm_options())
    os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", jvm_options())
    config.addinivalue_line("markers", "spark: needs a real Spark session")
    config.addinivalue_line("markers", "multihost: runs on simulated hosts (tests/simhosts.py); needs root")
    config.addinivalue_line("markers", "jax: Keras 3 on JAX; the JAX tier, run after jax is installed: pytest -m jax")
    config.addinivalue_line("markers", "slow: the slow multi-host tier, run before a release rather than in "
                                       "CI: pytest -m 'multihost and slow' -n 0")


def pytest_unconfigure(config):
    if _jvm_tmp:
        shutil.rmtree(_jvm_tmp, ignore_errors=True)
