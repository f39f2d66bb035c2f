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
    from sparktrain.driver.launch import cluster

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


#: The session that module_spark fixtures share in this test process: ((master, conf), session).
_shared: list = []


def _close_shared() -> None:
    if _shared:
        stop_spark(_shared.pop()[1])


def module_spark(master: str, **conf):
    """A module's fixture: one real SparkSession for every test of the module.

    Modules that ask for the same master and conf share one session, where xdist gives them to the
    same test process one after the other: it is kept open after a module, for the next one. Any
    other module closes it first (``_spark_modules_take_turns``), so a module that starts its own
    Spark (a local-cluster, a Connect server) finds none running; the last one closes at the end.
    """
    key = (master, tuple(sorted(conf.items())))

    @pytest.fixture(scope="module")
    def spark():
        if _shared and _shared[0][0] != key:
            _close_shared()
        if not _shared:
            _shared.append((key, make_spark(master, **conf)))
        yield _shared[0][1]

    spark._sparktrain_key = key
    return spark


@pytest.fixture(autouse=True, scope="module")
def _spark_modules_take_turns(request):
    """Before a module's tests: the shared session goes unless this module's ``spark`` is it."""
    keys = {getattr(v, "_sparktrain_key", None) for v in vars(request.module).values()}
    if _shared and _shared[0][0] not in keys:
        _close_shared()
    yield


def pytest_sessionfinish(session, exitstatus):
    _close_shared()


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


#: The class-data-sharing archive of Spark's classes (:class:`_SparkClassArchive`), which the
#: test processes find in this variable.
CDS_ENV = "SPARKTRAIN_TESTS_JVM_ARCHIVE"
#: Where the archive does not map (another Spark's jars, as in the stacks tier, or another JVM), the
#: JVM goes on without it; these keep it from saying so on the output that tests read.
CDS_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def jvm_options() -> str:
    """The options of every JVM this test process starts: a quick start, the archive of Spark's
    classes where there is one, and the process's temp dir."""
    options = JVM_QUICK_START
    archive = os.environ.get(CDS_ENV)
    if archive:
        options += f" -XX:SharedArchiveFile={archive} {CDS_QUIET}"
    return f"{options} -Djava.io.tmpdir={_jvm_tmp}" if _jvm_tmp else options


class _SparkClassArchive:
    """A class-data-sharing archive of the classes a Spark driver loads (a session, a barrier
    stage, a DataFrame), made in the background by one throw-away process as the run starts. Every
    JVM of the suite names it (``-XX:SharedArchiveFile``); one that starts before it is there, or
    whose class path is not this Spark's, goes on without it. The others start in about half the
    time: a local session in 1.8 s against 3.3 s here, and test_check, test_faults_cluster and
    test_bad_input together in 50 s against 62 s. The suite starts some eighty JVMs."""

    def __init__(self):
        import subprocess
        import threading

        self.dir = tempfile.mkdtemp(prefix="sparktrain-tests-cds-")
        self.path = os.path.join(self.dir, "spark.jsa")
        partial = self.path + ".partial"  # renamed once whole: no JVM maps half an archive
        # The JVM writes the archive as it exits, after the Python that started it: wait for it.
        code = ("import conftest; s = conftest.make_spark('local[2]'); jvm = s.sparkContext._gateway.proc; "
                "s.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda it: [1]).collect(); "
                "s.createDataFrame([(1, 'a')], 'x long, y string').groupBy('y').count().collect(); "
                "conftest.stop_spark(s); jvm.stdin.close(); jvm.wait(90)")
        env = {**os.environ, "SPARK_SUBMIT_OPTS": f"{JVM_QUICK_START} -Djava.io.tmpdir={self.dir} "
                                                  f"-XX:ArchiveClassesAtExit={partial} {CDS_QUIET}"}
        env.pop(CDS_ENV, None)
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def finish():
            try:
                if self.proc.wait(timeout=180) == 0 and os.path.exists(partial):
                    os.rename(partial, self.path)
            except (subprocess.TimeoutExpired, OSError):
                pass

        self.thread = threading.Thread(target=finish, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, not yet reaped: its pid is still ours
        self.proc.wait()
        self.thread.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def jvm_conf() -> dict[str, str]:
    """A Spark application's JVM options: :func:`jvm_options`, and the test log settings for its driver."""
    log = f"-Dlog4j2.configurationFile={HERE}/log4j2-test.properties"
    return {"spark.driver.extraJavaOptions": f"{jvm_options()} {log}", "spark.executor.extraJavaOptions": jvm_options()}


_archive: _SparkClassArchive | None = None


def _compile_bytecode() -> None:
    """Byte-compile sparktrain/ and tests/ once, before the test processes start.

    The editable install leaves sparktrain/ as source, and where PYTHONDONTWRITEBYTECODE is set (CI)
    Python never caches it: every rank, barrier task and script of the suite, about 1,500 processes,
    would compile the modules it imports again (45 ms for the driver's and the executor's). Stale or
    missing files are rewritten; the directories are git-ignored."""
    import compileall

    for name in ("sparktrain", "tests"):
        compileall.compile_dir(os.path.join(os.path.dirname(HERE), name), quiet=2)


def pytest_configure(config):
    global _jvm_tmp, _archive
    if (not hasattr(config, "workerinput") and CDS_ENV not in os.environ and shutil.which("java")
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS):
        # The first process of a run of the whole suite or a tier of it (xdist's controller, or the
        # only one) makes the archive, and the test processes it starts inherit the variable. A run
        # of a few named tests (the stacks tier's) would spend more on making it than it saves.
        _archive = _SparkClassArchive()
        os.environ[CDS_ENV] = _archive.path
    if not hasattr(config, "workerinput"):
        _compile_bytecode()
    _jvm_tmp = tempfile.mkdtemp(prefix="sparktrain-tests-jvm-")
    # Every JVM the suite starts through spark-submit (pyspark's gateway, the Connect server) or
    # spark-class (standalone master and workers) starts quickly too, with that temp dir.
    os.environ.setdefault("SPARK_SUBMIT_OPTS", jvm_options())
    os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", jvm_options())
    config.addinivalue_line("markers", "spark: needs a real Spark session")
    config.addinivalue_line("markers", "multihost: runs on simulated hosts (tests/simhosts.py); needs root")
    config.addinivalue_line("markers", "jax: Keras 3 on JAX; the JAX tier, run after jax is installed: pytest -m jax")
    config.addinivalue_line("markers", "keras2: Horovod users' code as they wrote it: Keras 2 on tf_keras "
                                       "(TF_USE_LEGACY_KERAS=1), their scripts, HorovodRunner; the users' tier, with "
                                       "notebooks: pytest -m '(keras2 or notebooks) and not jax and not multihost'")
    config.addinivalue_line("markers", "notebooks: the shipped notebooks, run in one Jupyter kernel; the users' tier, "
                                       "with keras2: pytest -m '(keras2 or notebooks) and not jax and not multihost'")
    config.addinivalue_line("markers", "slow: the slow tier, run before a release rather than in CI (whole jobs "
                                       "killed and resumed, the slower multi-host flows): bash tests/run slow")


def pytest_unconfigure(config):
    if _jvm_tmp:
        shutil.rmtree(_jvm_tmp, ignore_errors=True)
    if _archive:
        os.environ.pop(CDS_ENV, None)
        _archive.close()
