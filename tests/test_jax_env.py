"""What a JAX run hands its ranks, without Spark or JAX: the backend setting's order, each rank's
environment (CPU and GPU ranks), the mesh check and the quieted lines."""
from __future__ import annotations

import pytest

import sparktrain
from sparktrain import settings
from sparktrain.host import tflog
from sparktrain._jax import env as jax_env
from sparktrain.seam import topology, worker_env
from sparktrain.executor import rankenv
from sparktrain.seam.spec import TaskSpec


def test_the_backend_resolves_argument_then_keras_backend_then_spark_conf():
    conf = {"spark.sparktrain.backend": "jax"}
    assert settings.resolve("backend", "TensorFlow", environ={"KERAS_BACKEND": "jax"}, conf=conf) == "tensorflow"
    assert settings.resolve("backend", environ={"KERAS_BACKEND": "jax"}, conf={}) == "jax"
    assert settings.resolve("backend", environ={}, conf=conf) == "jax"
    assert settings.resolve("backend", environ={}, conf={}) is None  # the ranks keep their own
    with pytest.raises(sparktrain.InvalidArgumentError, match="backend must be one of .*jax.*got 'jaxx'"):
        sparktrain.run(lambda: 0, num_proc=-1, backend="jaxx")  # refused before anything starts


def _spec(backend, use_gpu=False, devices=1) -> TaskSpec:
    return TaskSpec(run_id="r", size=2, payload=b"", secret=b"", driver_address=None, use_gpu=use_gpu,
                    output_ranks=None, max_result_bytes=0, start_timeout=5, grace_period=1, user_env={},
                    backend=backend, jax_cpu_devices=devices)


@pytest.mark.parametrize("backend", ["jax", "tensorflow", None])
def test_a_rank_of_a_jax_run_gets_the_coordinator_and_the_cpu_platform(tmp_path, backend):
    topo = topology.topology(["h0", "h1"], 1)
    env = rankenv.rank_env(_spec(backend, devices=4), 1, ["h0", "h1"], [5000, 5001], 5002, topo, None,
                           str(tmp_path), b"k", None)
    if backend == "jax":
        assert {k: env[k] for k in worker_env.JAX_VARS} == {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": "h0:5002", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
        assert (env["KERAS_BACKEND"], env["JAX_PLATFORMS"], env["JAX_NUM_CPU_DEVICES"]) == ("jax", "cpu", "4")
        assert env["MASTER_PORT"] == "5002"  # the coordinator is rank 0's reserved second port
        # XLA's threads capped where the rank has one core's share, as TensorFlow's are
        assert env.get("XLA_FLAGS") == ("--xla_cpu_multi_thread_eigen=false" if env["OMP_NUM_THREADS"] == "1" else None)
        assert "PJRT_NPROC" not in env  # 4 CPU devices: XLA's pools as they are
    else:
        assert not set(worker_env.JAX_VARS) & set(env)
        assert "XLA_FLAGS" not in env
        assert env.get("KERAS_BACKEND") == backend or backend is None


def test_xla_pools_of_a_cpu_rank_follow_its_threads_unless_set(tmp_path):
    topo = topology.topology(["h0", "h1"], 1)
    env = rankenv.rank_env(_spec("jax"), 1, ["h0", "h1"], [5000, 5001], 5002, topo, None, str(tmp_path), b"k", None)
    assert env["PJRT_NPROC"] == env["OMP_NUM_THREADS"]  # one CPU device: XLA's pools get the rank's threads
    assert jax_env.xla_thread_defaults(3, "-1", {"NPROC": "8"}) == {}
    assert jax_env.xla_thread_defaults(1, "-1", {"PJRT_NPROC": "2", "XLA_FLAGS": ""}) == {}
    assert jax_env.xla_thread_defaults(1, "0", {}) == {}  # a GPU rank: XLA's own


def test_a_gpu_rank_of_a_jax_run_keeps_its_gpu_and_jax_chooses_the_platform():
    env = jax_env.jax_env(["fe80::1", "h"], 0, 7000, "3")
    assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "[fe80::1]:7000"
    assert "JAX_PLATFORMS" not in env and "JAX_NUM_CPU_DEVICES" not in env


def test_a_mesh_that_does_not_hold_processes_times_devices_is_refused():
    import sparktrain.jax

    sparktrain.jax.check_mesh((3, 2), {"KERAS_DISTRIBUTION_NUM_PROCESSES": "3"}, local_devices=2)
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"shape \(2, 2\) holds 4 devices, but this run has 3 "
                                                              r"process\(es\) x 2 device\(s\) each = 6"):
        sparktrain.jax.check_mesh((2, 2), {"KERAS_DISTRIBUTION_NUM_PROCESSES": "3"}, local_devices=2)


def test_jax_join_and_shutdown_lines_are_dropped_at_the_default_level_and_shown_at_0():
    joined = "[Gloo] Rank 2 is connected to 2 peer ranks. Expected number of connected peer ranks is : 2"
    gone = "W0000 00:00:1795757917.733165 24986 coordination_service_agent.cc:450] WatchTasksAsync failed: CANCELLED"
    real = "E0000 00:00:1795757917.733165 24986 pjrt_client.cc:1] Gloo AllGather failed: Connection reset by peer"
    quiet, verbose = tflog.StartupFilter(2), tflog.StartupFilter(0)
    assert quiet.drops(joined, "stdout") and quiet.drops(gone)
    assert not quiet.drops(real) and not quiet.drops(joined)  # gloo prints it on stdout; only there is it dropped
    assert not verbose.drops(joined, "stdout") and not verbose.drops(gone)
    assert not quiet.drops("[Gloo] my own line", "stdout")
