"""conf/: every file parses, every key is one Spark itself reads, the three cluster files agree, the
GPU discovery script prints JSON Spark accepts, and the log4j2 file is a valid quiet configuration.

Keys are checked against the running JVM: Spark's registry of config entries, its resource-request
parser for the ``spark.*.resource.gpu.*`` family, and its executor-environment reader for
``spark.executorEnv.*``. A misspelt key fails all three.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import make_spark, stop_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
DISCOVERY = os.path.join(CONF, "get_gpus_resources.sh")


@pytest.fixture(scope="module")
def jvm():
    session = make_spark("local[1]")
    yield session.sparkContext._jvm
    stop_spark(session)


def spark_defaults(jvm) -> dict[str, str]:
    """conf/spark-defaults.conf as Spark's own properties-file reader sees it."""
    parsed = jvm.org.apache.spark.util.Utils.getPropertiesFromFile(os.path.join(CONF, "spark-defaults.conf"))
    # scala.collection.JavaConverters is in Scala 2.12 (pyspark 3.5) and 2.13 (pyspark 4);
    # scala.jdk.javaapi.CollectionConverters is in 2.13 only.
    return dict(jvm.scala.collection.JavaConverters.mapAsJavaMapConverter(parsed).asJava())


def synapse() -> dict:
    with open(os.path.join(CONF, "synapse-configure.json")) as f:
        return json.load(f)


def databricks() -> dict:
    with open(os.path.join(CONF, "databricks-cluster.json")) as f:
        return json.load(f)


def as_spark_conf(cluster: dict) -> dict[str, str]:
    """A Databricks cluster's settings as Spark keys: its env vars are the executors' environment."""
    return {**cluster["spark_conf"], **{f"spark.executorEnv.{k}": v for k, v in cluster["spark_env_vars"].items()}}


def spark_reads(jvm, key: str, value: str) -> bool:
    """Whether Spark itself reads ``key`` (set to ``value``), asked of the JVM."""
    conf = jvm.org.apache.spark.SparkConf(False).set(key, value)
    parts = key.split(".")
    if key.startswith("spark.executorEnv."):
        env = conf.getExecutorEnv()
        return any((env.apply(i)._1(), env.apply(i)._2()) == (key[len("spark.executorEnv."):], value)
                   for i in range(env.length()))
    if len(parts) == 5 and parts[2] == "resource":  # spark.<component>.resource.<name>.<field>
        utils = jvm.org.apache.spark.resource.ResourceUtils
        component, name, field = ".".join(parts[:2]), parts[3], parts[4]
        if field != "amount":
            conf.set(f"{component}.resource.{name}.amount", "1")  # a request needs an amount to be parsed
        if component == "spark.task":  # tasks name only an amount of each resource
            reqs = utils.parseResourceRequirements(conf, component)
            return field == "amount" and any(
                reqs.apply(i).resourceName() == name and float(reqs.apply(i).amount()) == float(value)
                for i in range(reqs.length()))
        reqs = utils.parseAllResourceRequests(conf, component)
        for i in range(reqs.length()):
            req = reqs.apply(i)
            if req.id().resourceName() != name:
                continue
            got = {"amount": str(req.amount()), "discoveryScript": req.discoveryScript().orElse(None),
                   "vendor": req.vendor().orElse(None)}
            return got.get(field) == value
        return False
    # Make sure the core config objects have registered their entries before asking the registry.
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    jvm.java.lang.Class.forName("org.apache.spark.internal.config.package$", True, loader)
    return jvm.org.apache.spark.internal.config.ConfigEntry.findEntry(key) is not None


def test_the_key_check_can_fail(jvm):
    assert spark_reads(jvm, "spark.task.cpus", "4")
    assert spark_reads(jvm, "spark.executor.resource.gpu.discoveryScript", "/x.sh")
    assert not spark_reads(jvm, "spark.task.cpu", "4")
    assert not spark_reads(jvm, "spark.executor.resource.gpu.amout", "1")
    assert not spark_reads(jvm, "spark.task.resource.gpu.discoveryScript", "/x.sh")


def test_every_key_in_every_file_is_read_by_spark(jvm):
    settings = {"spark-defaults.conf": spark_defaults(jvm), "synapse-configure.json": synapse()["conf"],
                "databricks-cluster.json": as_spark_conf(databricks())}
    unknown = [(name, key) for name, conf in settings.items() for key, value in conf.items()
               if not spark_reads(jvm, key, value)]
    assert unknown == []
    assert len(settings["spark-defaults.conf"]) >= 10


def test_spark_defaults_sets_up_one_gpu_rank_per_executor(jvm):
    conf = spark_defaults(jvm)
    assert conf["spark.executor.resource.gpu.amount"] == conf["spark.task.resource.gpu.amount"] == "1"
    for key in ("spark.executor.resource.gpu.discoveryScript", "spark.worker.resource.gpu.discoveryScript"):
        assert os.path.isabs(conf[key]) and conf[key].endswith("/get_gpus_resources.sh"), conf[key]
    assert conf["spark.task.cpus"] == conf["spark.executor.cores"]  # one task per executor
    assert conf["spark.dynamicAllocation.enabled"] == "false"
    size = jvm.org.apache.spark.network.util.JavaUtils.byteStringAsBytes
    assert 2**30 <= size(conf["spark.driver.maxResultSize"]) < size(conf["spark.driver.memory"])


def test_synapse_and_databricks_carry_the_same_settings(jvm):
    defaults = spark_defaults(jvm)
    syn, dbx = synapse(), databricks()
    shared = {k: v for k, v in defaults.items() if "discoveryScript" not in k and not k.startswith(
        ("spark.worker.", "spark.executor.resource.gpu.vendor", "spark.executor.cores", "spark.driver.memory"))}
    # The platforms discover GPUs themselves, and size executors from their own fields.
    assert syn["conf"] == shared
    assert as_spark_conf(dbx) == shared
    assert syn["executorCores"] == int(defaults["spark.executor.cores"]) == int(syn["conf"]["spark.task.cpus"])
    assert syn["numExecutors"] == dbx["num_workers"]
    assert "autoscale" not in dbx  # a fixed number of workers: barrier stages need every executor
    assert "gpu" in dbx["spark_version"]


# -- the GPU discovery script ---------------------------------------------------------------------

def fake_path(tmp_path, nvidia_smi: str | None) -> str:
    """A PATH holding bash and, if given, an nvidia-smi with this body (and nothing else)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("bash"), bin_dir / "bash")
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        expected = "--query-gpu=index --format=csv,noheader"  # what the script must ask
        fake.write_text(f'#!/usr/bin/env bash\n[[ "$*" == "{expected}" ]] || {{ echo "bad args: $*" >&2; exit 9; }}\n'
                        + nvidia_smi + "\n")
        fake.chmod(0o755)
    return str(bin_dir)


def discover(tmp_path, nvidia_smi: str | None, **env) -> subprocess.CompletedProcess:
    # Run the way Spark runs it: the file itself, through its #! line.
    return subprocess.run([DISCOVERY], env={"PATH": fake_path(tmp_path, nvidia_smi), **env}, capture_output=True,
                          text=True, timeout=30)


def test_discovery_script_prints_json_that_spark_parses(jvm, tmp_path):
    assert os.access(DISCOVERY, os.X_OK), "conf/get_gpus_resources.sh must be executable: Spark runs it directly"
    proc = discover(tmp_path, "printf '0\\n1\\n2\\n'")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"name": "gpu", "addresses": ["0", "1", "2"]}
    parsed = jvm.org.apache.spark.resource.ResourceInformation.parseJson(proc.stdout)
    assert (parsed.name(), list(parsed.addresses())) == ("gpu", ["0", "1", "2"])


def test_discovery_script_reports_positions_in_cuda_visible_devices(tmp_path):
    proc = discover(tmp_path, "printf '0\\n1\\n2\\n3\\n'", CUDA_VISIBLE_DEVICES="2,3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["addresses"] == ["0", "1"]


@pytest.mark.parametrize("nvidia_smi, env, message", [
    (None, {}, "nvidia-smi is not on PATH"),
    ("true", {}, "nvidia-smi lists no GPU on this node"),
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9", {},
     "nvidia-smi failed: NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"),
    ("echo 0", {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
], ids=["no-nvidia-smi", "zero-gpus", "driver-broken", "all-hidden"])
def test_discovery_script_fails_with_the_reason_when_it_finds_no_gpu(tmp_path, nvidia_smi, env, message):
    proc = discover(tmp_path, nvidia_smi, **env)
    assert proc.returncode == 1
    assert proc.stdout == ""  # nothing Spark could mistake for a resource
    assert message in proc.stderr, proc.stderr


# -- log4j2 ----------------------------------------------------------------------------------------

def test_log4j2_properties_is_a_quiet_configuration_log4j_accepts(jvm):
    log4j = jvm.org.apache.logging.log4j
    path = os.path.join(CONF, "log4j2.properties")
    source = log4j.core.config.ConfigurationSource.fromUri(jvm.java.io.File(path).toURI())
    # Parsed by the same factory Spark's log4j uses for .properties files, without replacing the tests' logging.
    config = log4j.core.config.properties.PropertiesConfigurationFactory().getConfiguration(None, source)
    config.initialize()
    assert config.getRootLogger().getLevel().toString() == "WARN"
    assert [ref.getRef() for ref in config.getRootLogger().getAppenderRefs()] == ["console"]
    assert list(config.getAppenders().keySet()) == ["console"]
    for noisy in ("org.apache.hadoop.util.NativeCodeLoader", "org.apache.spark.util.Utils"):
        assert config.getLoggerConfig(noisy).getLevel().toString() == "ERROR", noisy
    # Everything else keeps its warnings.
    assert config.getLoggerConfig("org.apache.spark.scheduler.TaskSetManager").getLevel().toString() == "WARN"
