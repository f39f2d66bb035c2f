"""GPU scheduling on local-cluster[3,1,1024] with fake GPUs: one GPU id per rank, slot check fires fast."""
from __future__ import annotations

import os
import time

import pytest

import sparktrain
from conftest import HERE, make_spark, stop_spark
from helpers import fault_time, read_ranks, record_rank

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster():
    session = make_spark(
        "local-cluster[3,1,1024]",
        **{
            "spark.worker.resource.gpu.amount": "3",
            "spark.worker.resource.gpu.discoveryScript": os.path.join(HERE, "fake_gpu_discovery.sh"),
            "spark.executor.resource.gpu.amount": "1",
            "spark.task.resource.gpu.amount": "1",
            # The executors run under a GPU mask, as on a shared machine: Spark's ids index into it.
            "spark.executorEnv.CUDA_VISIBLE_DEVICES": "5,6,7",
            "spark.executor.memory": "512m",
        },
    )
    yield session
    stop_spark(session)


def see_gpus(outdir):
    import os

    record_rank(outdir, visible=os.environ["CUDA_VISIBLE_DEVICES"])
    return os.environ["CUDA_VISIBLE_DEVICES"]


def test_each_rank_sees_exactly_one_gpu(cluster, tmp_path):
    result = sparktrain.run(see_gpus, args=(str(tmp_path),), num_proc=3, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    for info in ranks.values():
        ids = info["visible"].split(",")
        assert len(ids) == 1 and ids[0] in {"5", "6", "7"}, info["visible"]  # translated through the mask
    assert result == ranks[0]["visible"]
    # Three executors on one machine: one host, so local ranks 0..2.
    assert sorted(r["local_rank"] for r in ranks.values()) == [0, 1, 2]
    assert {r["local_size"] for r in ranks.values()} == {3}


def test_a_study_runs_three_one_gpu_gangs_at_once_each_on_its_own_gpu(cluster):
    optuna = pytest.importorskip("optuna")
    import sparktrain.tune
    import tune_objectives

    study = optuna.create_study()
    with pytest.raises(sparktrain.InvalidArgumentError, match="need 4 task slots at once; the cluster has 3"):
        sparktrain.tune.optimize(study, tune_objectives.where, n_trials=4, concurrent_trials=4, num_proc=1)
    sparktrain.tune.optimize(study, tune_objectives.where, n_trials=3, num_proc=1, resources={"gpus": 1},
                             verbose=0)  # as many gangs as the slots hold: 3
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    seen = [t.user_attrs["gpus_rank_0"] for t in study.trials]
    assert all(g in ("5", "6", "7") for g in seen), seen
    # All three ran at once (none waited for another's slot): the 3 GPU slots held 3 gangs, one GPU each.
    ends = [t.datetime_complete for t in study.trials]
    assert all(t.datetime_start < min(ends) for t in study.trials)


def test_slot_check_fires_within_seconds_when_4_gpus_are_asked_of_3(cluster):
    started = time.monotonic()
    with pytest.raises(sparktrain.InsufficientResourcesError) as e:
        sparktrain.run(see_gpus, args=("/nonexistent",), num_proc=4, verbose=0)
    elapsed = time.monotonic() - started
    msg = str(e.value)
    assert "num_proc=4 needs 4 GPU task slots" in msg and "the cluster has 3" in msg, msg
    assert "Fix: lower num_proc to 3" in msg, msg
    fault_time("GPU slot check refuses 4 of 3", 10, elapsed)


def see_jax_launch(outdir):
    """What a GPU rank of a JAX run is handed (JAX itself is not imported: there is no GPU here)."""
    import os

    keys = ("CUDA_VISIBLE_DEVICES", "KERAS_BACKEND", "KERAS_DISTRIBUTION_JOB_ADDRESSES",
            "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID", "JAX_PLATFORMS",
            "JAX_NUM_CPU_DEVICES", "MASTER_ADDR", "MASTER_PORT")
    record_rank(outdir, jax_env={k: os.environ.get(k) for k in keys})
    return 0


def test_a_jax_run_on_gpus_gives_each_rank_its_gpu_and_the_coordinator_and_leaves_the_platform_to_jax(
        cluster, tmp_path):
    sparktrain.run(see_jax_launch, args=(str(tmp_path),), num_proc=3, backend="jax", verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    coordinator = {info["jax_env"]["KERAS_DISTRIBUTION_JOB_ADDRESSES"] for info in ranks.values()}
    env0 = ranks[0]["jax_env"]
    assert coordinator == {f"{env0['MASTER_ADDR']}:{env0['MASTER_PORT']}"}
    for info in ranks.values():  # one GPU each, Spark's id translated through the executors' mask
        assert info["jax_env"]["CUDA_VISIBLE_DEVICES"] in {"5", "6", "7"}, info["jax_env"]
    for r, info in ranks.items():
        env = info["jax_env"]
        assert (env["KERAS_BACKEND"], env["KERAS_DISTRIBUTION_NUM_PROCESSES"]) == ("jax", "3")
        assert env["KERAS_DISTRIBUTION_PROCESS_ID"] == str(r)  # JAX's process id is the sparktrain rank
        # A GPU rank is not confined to JAX's CPU platform: JAX picks its GPU.
        assert env["JAX_PLATFORMS"] is None and env["JAX_NUM_CPU_DEVICES"] is None, env


def test_use_gpu_false_hides_gpus(cluster, tmp_path):
    assert sparktrain.run(see_gpus, args=(str(tmp_path),), num_proc=3, use_gpu=False, verbose=0) == "-1"


def gpu_rank_view(outdir):
    """What a GPU rank of this attempt is given and builds: its GPU, the workers its collective
    runtime is made of (TF_CONFIG), and, traced as a GPU rank builds it (there is no GPU here),
    the NCCL allreduce op with its group size. Ranks of the first attempt then wait to be lost."""
    import json
    import time

    from helpers import mark_time

    attempt = int(os.environ["SPARKTRAIN_ELASTIC_ATTEMPT"])
    rank, size = int(os.environ["SPARKTRAIN_RANK"]), int(os.environ["SPARKTRAIN_SIZE"])
    traced = {}
    if rank == 0:  # one rank traces (TensorFlow's import is most of a rank's cost); all build alike
        import tensorflow as tf

        from sparktrain.tensorflow import ringops
        from sparktrain.tensorflow.runtime import state

        state.gpu, state.size, state.rank = True, size, rank  # the state init() leaves on a GPU rank
        graph = tf.function(lambda t: ringops.allreduce(t, "sum")).get_concrete_function(
            tf.TensorSpec([8], tf.float32)).graph
        op = next(o for o in graph.get_operations() if o.type == "CollectiveReduceV2")
        traced = {"hint": op.get_attr("communication_hint").decode(),
                  "group_size": int(tf.get_static_value(op.inputs[1]))}
    record_rank(outdir, f"-attempt{attempt}", visible=os.environ["CUDA_VISIBLE_DEVICES"],
                workers=json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"], **traced)
    if attempt == 1:
        mark_time(outdir, f"running-{rank}")
        while True:  # until its executor is taken away, or the driver stops it
            time.sleep(0.1)
    return size


def test_an_elastic_gpu_run_that_loses_an_executor_goes_on_with_the_gpus_left(cluster, tmp_path, caplog):
    """run_elastic of 3 GPU ranks (min 2); the executor of one is taken away for good (killed,
    its slot not replaced). The next attempt has 2 ranks: each on a GPU of an executor that is
    left, its collective runtime made of the 2 workers, and its NCCL allreduce built for a group
    of 2. Put last: the module's cluster keeps 2 executors afterwards."""
    import threading

    from helpers import wait_for_file

    outdir = str(tmp_path)
    sc = cluster.sparkContext

    def take_one_away():
        for r in range(3):
            wait_for_file(os.path.join(outdir, f"running-{r}"), 120)
        ids = sorted(str(sc._jsc.sc().getExecutorIds().mkString(",")).split(","))
        assert sc._jsc.sc().killExecutor(ids[-1])  # no replacement: the target count drops with it

    caplog.set_level("INFO", logger="sparktrain")
    killer = threading.Thread(target=take_one_away, daemon=True)
    killer.start()
    try:
        size = sparktrain.run_elastic(gpu_rank_view, args=(outdir,), num_proc=3, min_num_proc=2, use_gpu=True,
                                      env={"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic",
                                           "TF_CPP_MIN_LOG_LEVEL": "3"}, verbose=1, elastic_timeout=60, timeout=150)
    finally:
        killer.join(60)
    first, second = read_ranks(outdir, "-attempt1"), read_ranks(outdir, "-attempt2")
    assert size == 2 and sorted(first) == [0, 1, 2] and sorted(second) == [0, 1], (first, second)
    for ranks, n in ((first, 3), (second, 2)):
        # One GPU each, translated through the executors' mask. (Each local-cluster worker offers the
        # same fake ids, so ranks on different executors may see the same number.)
        gpus = [ranks[r]["visible"].split(",") for r in sorted(ranks)]
        assert all(len(g) == 1 and g[0] in {"5", "6", "7"} for g in gpus), gpus
        assert all(len(ranks[r]["workers"]) == n for r in ranks)  # the runtime is rebuilt at the new size
        assert (ranks[0]["hint"], ranks[0]["group_size"]) == ("nccl", n)
    lines = [r.getMessage() for r in caplog.records if "continuing with 2 rank(s)" in r.getMessage()]
    assert len(lines) == 1 and "was lost" in lines[0], lines

