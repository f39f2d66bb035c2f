"""Resources per run on local-cluster with fake GPUs: the application's tasks ask for no GPU, a
run's barrier stage asks for its own through a ResourceProfile, and the CPU stages around it are
untouched.

One executor with 3 cores and 3 GPUs (ids 0, 1, 2, under the mask 5,6,7), so the ranks of one
stage share it and each must get a distinct GPU.
"""
from __future__ import annotations

import os

import pyspark
import pytest
from pyspark.sql import DataFrame

import sparktrain
from conftest import HERE, make_spark, stop_spark
from connect_server import ConnectServer, needs_server
from helpers import read_ranks, record_rank
from sparktrain.driver.launch import capacity
from sparktrain.host.cpus import THREAD_VARS

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

#: Why this pyspark cannot give a stage task resources of its own (None: it can), as the driver tells.
NO_PROFILES = capacity.profile_unsupported(DataFrame.mapInArrow, pyspark.__version__)
needs_profiles = pytest.mark.skipif(
    NO_PROFILES is not None, reason=f"needs a stage's own task resources, and {NO_PROFILES}; "
    "test_a_pyspark_without_profiles_is_refused_before_any_job asserts the driver's refusal here")


GPU_CLUSTER = {
    "spark.worker.resource.gpu.amount": "3",
    "spark.worker.resource.gpu.discoveryScript": os.path.join(HERE, "fake_gpu_discovery.sh"),
    "spark.executor.resource.gpu.amount": "3",
    # No spark.task.resource.gpu.amount: the application's tasks ask for no GPU.
    "spark.executorEnv.CUDA_VISIBLE_DEVICES": "5,6,7",
    "spark.executor.memory": "512m",
}


@pytest.fixture(scope="module")
def cluster():
    session = make_spark("local-cluster[1,3,1024]", **GPU_CLUSTER)
    yield session
    stop_spark(session)


def see_resources(outdir):
    import os

    record_rank(outdir, visible=os.environ["CUDA_VISIBLE_DEVICES"],
                threads={k: os.environ.get(k) for k in THREAD_VARS})
    return os.environ["CUDA_VISIBLE_DEVICES"]


def _cpu_stage(spark) -> list[tuple]:
    """An ordinary (not barrier) stage of 6 tasks: what each task holds."""

    def tasks(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        for _ in batches:
            pass
        gpu = ctx.resources().get("gpu")
        yield pa.RecordBatch.from_arrays(
            [pa.array([ctx.partitionId()]), pa.array([ctx.cpus()]),
             pa.array([",".join(gpu.addresses) if gpu else ""])], names=["task", "cpus", "gpus"])

    rows = spark.range(0, 6, 1, 6).mapInArrow(tasks, "task long, cpus long, gpus string").collect()
    return sorted((r["task"], r["cpus"], r["gpus"]) for r in rows)


def _jobs_started(spark) -> int:
    return int(spark.sparkContext._jsc.sc().dagScheduler().nextJobId())


@needs_profiles
def test_gpu_run_between_cpu_stages(cluster, tmp_path):
    assert "spark.task.resource.gpu.amount" not in dict(cluster.sparkContext.getConf().getAll())
    before = _cpu_stage(cluster)
    assert before == [(t, 1, "") for t in range(6)]  # the default profile: 1 core, no GPU

    result = sparktrain.run(see_resources, args=(str(tmp_path),), num_proc=3, use_gpu=True, verbose=0)

    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    visible = [ranks[r]["visible"] for r in range(3)]
    assert sorted(visible) == ["5", "6", "7"], visible  # one GPU each, distinct, through the mask
    assert result == visible[0]
    for info in ranks.values():  # threads follow the task's 1 core
        assert info["threads"] == {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                                   "TF_NUM_INTEROP_THREADS": "2"}, info["threads"]

    assert _cpu_stage(cluster) == before


@needs_profiles
def test_resources_cpus_and_gpus_reach_the_rank(cluster, tmp_path):
    # num_proc=None: as many ranks as the profile's slots, 3 cores / 3 cpus per rank = 1.
    sparktrain.run(see_resources, args=(str(tmp_path),), resources={"cpus": 3, "gpus": 2}, verbose=0,
                   env={"TF_NUM_INTEROP_THREADS": "1"})
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0]
    assert sorted(ranks[0]["visible"].split(",")) in (["5", "6"], ["5", "7"], ["6", "7"]), ranks[0]["visible"]
    assert ranks[0]["threads"] == {"OMP_NUM_THREADS": "3", "TF_NUM_INTRAOP_THREADS": "3",
                                   "TF_NUM_INTEROP_THREADS": "1"}  # the user's env wins


@needs_profiles
def test_cpu_only_resources_hide_gpus(cluster, tmp_path):
    assert sparktrain.run(see_resources, args=(str(tmp_path),), num_proc=1, resources={"cpus": 2},
                          verbose=0) == "-1"
    assert read_ranks(str(tmp_path))[0]["threads"]["OMP_NUM_THREADS"] == "2"


@needs_profiles
@pytest.mark.parametrize("kwargs, words", [
    (dict(num_proc=2, resources={"cpus": 2}),
     ["num_proc=2 needs 2 task slots", "the cluster has 1",
      "1 executor(s) x 3 core(s) / cpus per rank (the run's resource profile)=2 = 1 CPU slot(s)",
      "lower num_proc to 1"]),
    (dict(num_proc=4, use_gpu=True),
     ["num_proc=4 needs 4 GPU task slots", "the cluster has 3",
      "1 executor(s) x 3 GPU(s) / gpus per rank (the run's resource profile)=1 = 3 GPU slot(s)"]),
    (dict(num_proc=1, resources={"cpus": 4}),
     ["the cluster has 0", "/ cpus per rank (the run's resource profile)=4 = 0 CPU slot(s)",
      "ask for fewer cpus per rank"]),
])
def test_capacity_check_counts_the_profile(cluster, kwargs, words):
    before = _jobs_started(cluster)
    with pytest.raises(sparktrain.InsufficientResourcesError) as e:
        sparktrain.run(see_resources, args=("/nonexistent",), verbose=0, **kwargs)
    msg = str(e.value)
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"
    assert _jobs_started(cluster) == before


def count_rows():
    import os

    import sparktrain.data

    s = sparktrain.data.shard("train")
    return s.total_rows, os.environ["CUDA_VISIBLE_DEVICES"], os.environ["OMP_NUM_THREADS"]


@needs_profiles
def test_fed_dataframe_goes_through_the_profiled_stage(cluster):
    df = cluster.range(0, 30).toDF("x")
    total, visible, threads = sparktrain.run(count_rows, num_proc=2, data=df, resources={"gpus": 1}, verbose=0)
    assert (total, threads) == (30, "1")
    assert visible in ("5", "6", "7")


def fail_first_attempt():
    import os

    import sparktrain

    if sparktrain.attempt() == 1 and sparktrain.rank() == 1:
        raise RuntimeError("rank 1 fails its first attempt on purpose")
    return sparktrain.attempt(), os.environ["CUDA_VISIBLE_DEVICES"]


@needs_profiles
def test_a_retried_attempt_asks_for_the_same_resources(cluster):
    attempt, visible = sparktrain.run(fail_first_attempt, num_proc=2, use_gpu=True, max_attempts=2, verbose=0)
    assert attempt == 2 and visible in ("5", "6", "7")


def map_in_arrow_35(self, func, schema, barrier=False):
    raise AssertionError("the driver must refuse the run before it launches anything")


def test_a_pyspark_without_profiles_is_refused_before_any_job(cluster, monkeypatch):
    if NO_PROFILES is None:  # a pyspark with profile=: give the session's DataFrames pyspark 3.5's method
        monkeypatch.setattr(type(cluster.range(0)), "mapInArrow", map_in_arrow_35)
    before = _jobs_started(cluster)
    for kwargs in (dict(use_gpu=True), dict(resources={"cpus": 2})):
        with pytest.raises(sparktrain.ClusterConfigError) as e:
            sparktrain.run(see_resources, args=("/nonexistent",), num_proc=1, verbose=0, **kwargs)
        assert "this run needs its own task resources" in str(e.value)
        assert f"{pyspark.__version__}'s DataFrame.mapInArrow(func, schema, barrier) takes no profile= (it came " \
               "in pyspark 4.0). Upgrade to pyspark 4.0 or later, or set spark.task.cpus" in str(e.value), str(e.value)
    assert _jobs_started(cluster) == before


CONNECT_CLIENT = """
import os, sys
from pyspark.sql import SparkSession
import sparktrain

def see(outdir):
    import os
    import sparktrain
    with open(os.path.join(outdir, f"visible-{sparktrain.rank()}"), "w") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"])
    return os.environ["CUDA_VISIBLE_DEVICES"]

url, outdir = sys.argv[1:3]
spark = SparkSession.builder.remote(url).getOrCreate()
print("RESULT", sparktrain.run(see, args=(outdir,), num_proc=3, use_gpu=True, verbose=0))
print("VISIBLE", ",".join(open(os.path.join(outdir, f"visible-{r}")).read() for r in range(3)))
try:
    sparktrain.run(see, args=(outdir,), num_proc=4, use_gpu=True, verbose=0)
except sparktrain.InsufficientResourcesError as e:
    print("REFUSED", str(e).splitlines()[0])
spark.stop()
"""


@needs_profiles
@needs_server
def test_a_gpu_run_over_spark_connect_gets_its_own_profile(tmp_path):
    # The same cluster behind a Spark Connect server: the client sends the profile with the stage.
    # The client is a process of its own: this one may hold a classic session, which pyspark does
    # not let a Connect session share a process with.
    pytest.importorskip("grpc")
    import subprocess
    import sys

    server = ConnectServer("local-cluster[1,3,1024]", conf=GPU_CLUSTER)
    try:
        env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_AUTHENTICATE_TOKEN"}
        proc = subprocess.run([sys.executable, "-c", CONNECT_CLIENT, server.url, str(tmp_path)], capture_output=True,
                              text=True, timeout=240, env=env)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("RESULT", "VISIBLE", "REFUSED"))
    assert sorted(lines["VISIBLE"].split(",")) == ["5", "6", "7"], proc.stdout  # one GPU each, distinct
    assert lines["RESULT"] == lines["VISIBLE"].split(",")[0]
    assert lines["REFUSED"].startswith("num_proc=4 needs 4 GPU task slots at once"), proc.stdout
    assert "limited by GPUs" in lines["REFUSED"], proc.stdout
