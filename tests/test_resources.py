"""Resources per run, on the driver: ``resources=`` checks, the stage's task resources, slot
arithmetic for a run's own profile, and the threads each rank gets. No Spark session: the one run
here is in local mode."""
from __future__ import annotations

import os

import pytest

import sparktrain
from sparktrain.host import cpus
from sparktrain.seam import worker_env
from sparktrain.driver.launch import capacity
from sparktrain.driver.launch.capacity import TaskResources
from sparktrain.errors import ClusterConfigError, InsufficientResourcesError, InvalidArgumentError

pytestmark = pytest.mark.timeout(60)

GPU_EXECUTORS = {"spark.executor.resource.gpu.amount": "1"}


def noop():
    return None


@pytest.mark.parametrize("resources, use_gpu, expected", [
    (None, None, None),
    ({"cpus": 4, "gpus": 1}, None, TaskResources(4, 1.0)),
    ({"cpus": 2}, None, TaskResources(2, None)),
    ({"gpus": 2}, True, TaskResources(None, 2.0)),
    ({"gpus": 0.25}, None, TaskResources(None, 0.25)),
    ({"gpus": 0}, False, TaskResources(None, 0.0)),
])
def test_resources_accepted(resources, use_gpu, expected):
    assert capacity.check_resources(resources, use_gpu) == expected


@pytest.mark.parametrize("resources, use_gpu, words", [
    ("cpus=4", None, r"resources must be a dict.*\{'cpus': 4, 'gpus': 1\}.*got 'cpus=4' \(str\)"),
    ({"gpu": 1}, None, r"unknown key\(s\) \['gpu'\]; use 'cpus'.*and 'gpus'"),
    ({}, None, r"resources is empty"),
    ({"cpus": 0}, None, r"resources\['cpus'\] must be a whole number of cores per rank, at least 1, got 0"),
    ({"cpus": 1.5}, None, r"resources\['cpus'\].*got 1\.5"),
    ({"cpus": "4"}, None, r"resources\['cpus'\].*got '4'"),
    ({"cpus": True}, None, r"resources\['cpus'\].*got True"),
    ({"gpus": 0.75}, None, r"resources\['gpus'\].*fraction of at most 0\.5.*got 0\.75"),
    ({"gpus": -1}, None, r"resources\['gpus'\].*got -1"),
    ({"gpus": float("nan")}, None, r"resources\['gpus'\].*got nan"),
    ({"gpus": 1}, False, r"use_gpu=False contradicts resources\['gpus'\]=1"),
    ({"gpus": 0}, True, r"use_gpu=True contradicts resources\['gpus'\]=0"),
])
def test_bad_resources_echo_the_value_and_the_fix(resources, use_gpu, words):
    with pytest.raises(InvalidArgumentError, match=words):
        capacity.check_resources(resources, use_gpu)


def test_run_refuses_bad_resources_before_spark(monkeypatch):
    # Every error must come before a SparkSession would be looked for or started.
    import pyspark.sql

    from sparktrain.driver.launch import cluster

    def no_spark(*a, **k):
        raise AssertionError("a SparkSession was asked for")

    monkeypatch.setattr(cluster, "active_session", no_spark)
    monkeypatch.setattr(cluster, "start_session", no_spark)
    monkeypatch.setattr(pyspark.sql.SparkSession, "builder", None)
    for resources in ({"gpu": 1}, {"cpus": 0}, "4 cpus", {"gpus": 0.7}):
        with pytest.raises(InvalidArgumentError, match="resources"):
            sparktrain.run(noop, num_proc=2, resources=resources, verbose=0)
    with pytest.raises(InvalidArgumentError, match="use_gpu=False contradicts"):
        sparktrain.run(noop, num_proc=2, resources={"gpus": 1}, use_gpu=False, verbose=0)
    with pytest.raises(InvalidArgumentError, match=r"local mode gives each rank one GPU.*resources\['gpus'\]=2 cannot be met"):
        sparktrain.run(noop, num_proc=-2, resources={"gpus": 2}, verbose=0)


def test_default_profile_needs_no_stage_profile():
    assert capacity.stage_resources({}, None, use_gpu=False) is None
    # The application's tasks already ask for a GPU each: today's behaviour, no profile.
    assert capacity.stage_resources({"spark.task.resource.gpu.amount": "1", **GPU_EXECUTORS}, None, True) is None
    # Asking for what the default profile gives anyway needs no profile either.
    assert capacity.stage_resources({"spark.task.cpus": "2"}, TaskResources(2, None), False) is None


def test_use_gpu_on_a_cpu_application_builds_a_one_gpu_profile():
    assert capacity.stage_resources(GPU_EXECUTORS, None, use_gpu=True) == TaskResources(1, 1.0)
    conf = {**GPU_EXECUTORS, "spark.task.cpus": "2"}
    assert capacity.stage_resources(conf, None, use_gpu=True) == TaskResources(2, 1.0)
    assert capacity.stage_resources(conf, TaskResources(4, None), use_gpu=True) == TaskResources(4, 1.0)
    assert capacity.stage_resources(conf, TaskResources(None, 2.0), use_gpu=True) == TaskResources(2, 2.0)


def test_cpu_run_on_a_gpu_application_gives_its_gpus_back():
    conf = {"spark.task.resource.gpu.amount": "1", **GPU_EXECUTORS}
    assert capacity.stage_resources(conf, TaskResources(2, None), use_gpu=False) == TaskResources(2, 0.0)


def test_gpus_without_gpu_executors_are_refused_with_the_fix():
    with pytest.raises(ClusterConfigError, match=r"use_gpu=True asks for 1 GPU\(s\) per rank, but "
                                                 r"spark.executor.resource.gpu.amount is not set"):
        capacity.stage_resources({}, None, use_gpu=True)
    with pytest.raises(ClusterConfigError, match=r"resources\['gpus'\]=2 asks for 2 GPU"):
        capacity.stage_resources({}, TaskResources(None, 2.0), use_gpu=True)


def test_local_master_keeps_todays_gpu_error_and_refuses_a_profile():
    with pytest.raises(ClusterConfigError, match="spark.task.resource.gpu.amount=1"):
        capacity.stage_resources({}, None, use_gpu=True, local_master=True)
    with pytest.raises(ClusterConfigError, match=r"local\[N\] master does not schedule stages by resource profile"):
        capacity.stage_resources({}, TaskResources(2, None), use_gpu=False, local_master=True)


def map_in_arrow_35(self, func, schema, barrier=False):
    """pyspark 3.5's DataFrame.mapInArrow (classic and Connect)."""


def map_in_arrow_40(self, func, schema, barrier=False, profile=None):
    """pyspark 4.0's, which takes a ResourceProfile."""


def test_a_mapinarrow_without_profile_gets_a_clear_error():
    # The parameters decide, not the version: a 4.x number with 3.5's method is refused too.
    for version in ("3.5.2", "4.9.0"):
        with pytest.raises(ClusterConfigError, match=rf"and pyspark {version}'s DataFrame.mapInArrow\(func, schema, "
                                                     r"barrier\) takes no profile= \(it came in pyspark 4.0\)\. Upgrade"):
            capacity.check_profile_support(map_in_arrow_35, version)
    capacity.check_profile_support(map_in_arrow_40, "3.5.2")
    assert capacity.profile_unsupported(map_in_arrow_40, "4.0.0") is None
    assert capacity.profile_unsupported(min, "4.0.0") is None  # no signature to read: the call decides


def test_slots_are_counted_for_the_profile_and_the_error_gives_the_figures():
    cap = capacity.Capacity(executors=2, cores_per_executor=4, task_cpus=3, gpus_per_executor=2, task_gpus=1,
                             profile=True)
    assert (cap.cpu_slots, cap.gpu_slots, cap.slots(True)) == (2, 4, 2)
    with pytest.raises(InsufficientResourcesError) as e:
        capacity.check_capacity(3, cap, use_gpu=True)
    msg = str(e.value)
    assert "num_proc=3 needs 3 GPU task slots" in msg and "the cluster has 2" in msg, msg
    assert "2 executor(s) x 4 core(s) / cpus per rank (the run's resource profile)=3 = 2 CPU slot(s)" in msg, msg
    assert "gpus per rank (the run's resource profile)=1 = 4 GPU slot(s)" in msg, msg
    assert "limited by CPU task slots" in msg and "lower num_proc to 2" in msg, msg
    none_fit = capacity.Capacity(2, 4, 8, profile=True)
    with pytest.raises(InsufficientResourcesError, match="ask for fewer cpus per rank"):
        capacity.check_capacity(1, none_fit, use_gpu=False)


def test_threads_follow_the_cpus_unless_the_user_sets_them():
    assert cpus.rank_threads(4, 16, 2) == 4  # the task's cpus, not the host's share
    assert cpus.rank_threads(None, 16, 2) == 8
    assert cpus.thread_defaults(4, {}) == {
        "OMP_NUM_THREADS": "4", "TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "4"}
    assert cpus.thread_defaults(1, {"TF_NUM_INTEROP_THREADS": "8"}) == {
        "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def report_threads():
    import os

    return {k: os.environ.get(k) for k in cpus.THREAD_VARS}


def test_local_mode_threads_follow_resources_cpus():
    assert sparktrain.run(report_threads, num_proc=-1, resources={"cpus": 3}, verbose=0) == {
        "OMP_NUM_THREADS": "3", "TF_NUM_INTRAOP_THREADS": "3", "TF_NUM_INTEROP_THREADS": "3"}


def all_ranks_cores(outdir):
    import json
    import os

    import sparktrain

    with open(os.path.join(outdir, f"cores-{sparktrain.rank()}.json"), "w") as f:
        json.dump(sorted(os.sched_getaffinity(0)), f)


def cores_of(outdir, n):
    import json

    return [json.load(open(os.path.join(outdir, f"cores-{r}.json"))) for r in range(n)]


@pytest.mark.timeout(120)
def test_ranks_that_own_the_machine_keep_to_cores_of_their_own(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    sparktrain.run(all_ranks_cores, args=(str(tmp_path),), num_proc=-2, verbose=0)
    first, second = cores_of(str(tmp_path), 2)
    half = len(allowed) // 2
    assert first == allowed[:half] and second == allowed[half:2 * half]  # disjoint, one share each
    # More ranks than cores: the kernel shares them; "off" leaves every rank on every core.
    sparktrain.run(all_ranks_cores, args=(str(tmp_path),), num_proc=-(len(allowed) + 1), verbose=0)
    assert all(c == allowed for c in cores_of(str(tmp_path), len(allowed) + 1))
    monkeypatch.setenv("SPARKTRAIN_PIN_CORES", "off")
    sparktrain.run(all_ranks_cores, args=(str(tmp_path),), num_proc=-2, verbose=0)
    assert cores_of(str(tmp_path), 2) == [allowed, allowed]
    monkeypatch.setenv("SPARKTRAIN_PIN_CORES", "sometimes")
    with pytest.raises(sparktrain.InvalidArgumentError, match="SPARKTRAIN_PIN_CORES must be one of auto, on, off; got 'sometimes'"):
        sparktrain.run(all_ranks_cores, args=(str(tmp_path),), num_proc=-2, verbose=0)
