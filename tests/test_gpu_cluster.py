"""GPU scheduling on local-cluster[3,1,1024] with fake GPUs: one GPU id per rank, slot check fires fast."""
from __future__ import annotations

import os
import time

import pytest

import sparktrain
from conftest import HERE, make_spark, stop_spark
from helpers import read_ranks, record_rank

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


def test_slot_check_fires_within_seconds_when_4_gpus_are_asked_of_3(cluster):
    started = time.monotonic()
    with pytest.raises(sparktrain.InsufficientResourcesError) as e:
        sparktrain.run(see_gpus, args=("/nonexistent",), num_proc=4, verbose=0)
    elapsed = time.monotonic() - started
    msg = str(e.value)
    assert "num_proc=4 needs 4 GPU task slots" in msg and "the cluster has 3" in msg, msg
    assert "Fix: lower num_proc to 3" in msg, msg
    assert elapsed < 10, f"the slot check took {elapsed:.1f} s"


def test_use_gpu_false_hides_gpus(cluster, tmp_path):
    assert sparktrain.run(see_gpus, args=(str(tmp_path),), num_proc=3, use_gpu=False, verbose=0) == "-1"
