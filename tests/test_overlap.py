"""Gradient buckets reduced on the engine's thread while backprop goes on (tensorflow.buckets), on
a real local[3] Spark: the same bits as the fused reduction on 3 and 2 ranks for Keras 3's
DistributedOptimizer (with fp16 compression, predivision, Sum and two backward passes) and the
gradient tape; TensorFlow's only thread running another op while a bucket waits for a peer; the
buckets in program order when one rank's gradients come in another order; a mismatch refused
naming both shapes; a rank that dies while a bucket waits failing the run by name."""
from __future__ import annotations

import json

import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks
from sparktrain import engine

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]

from overlap_ranks import FIT_VARIANTS, dies_in_a_bucket, engine_thread_and_order, fused_against_buckets  # noqa: E402

spark = module_spark("local[3]")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def three_ranks(spark, tmp_path_factory):
    outdir = tmp_path_factory.mktemp("buckets3")
    sparktrain.run(fused_against_buckets, args=(str(outdir),), num_proc=3, env=ENV, verbose=0)
    return outdir, read_ranks(str(outdir))


def test_buckets_give_the_fused_reductions_bits_on_3_ranks(three_ranks):
    _, ranks = three_ranks
    assert sorted(ranks) == [0, 1, 2]
    assert {info["kernels"] for info in ranks.values()} == {"native"}
    paths = [f"fit {name}" for name in FIT_VARIANTS] + ["tape"]
    for path in paths:
        fused, bucketed = ranks[0]["digests"][path]
        assert fused == bucketed, path
        assert {info["digests"][path][1] for info in ranks.values()} == {bucketed}, path  # every rank's bits
    # The variants train differently, so a digest that ignored its inputs could not pass.
    assert len({ranks[0]["digests"][p][0] for p in paths}) == len(paths)
    assert all("sparktrain-grad" in info["threads"] for info in ranks.values())


def test_the_timeline_shows_each_bucket_on_the_engines_lane(three_ranks):
    outdir, _ = three_ranks
    for rank, name in ((0, "trace.json"), (2, "trace.rank2.json")):
        events = json.loads((outdir / name).read_text())["traceEvents"]
        lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert lanes == {0: "TensorFlow", 1: "engine thread: gradient buckets"}
        buckets = [e for e in events if e.get("ph") == "X" and e["tid"] == 1]
        ready = [e for e in events if e.get("ph") == "i" and e["name"].endswith(" ready")]
        names = {e["name"].split(" (")[0] for e in buckets}
        # Four layers of 16 KiB buckets: several per step, each named with its share.
        count = int(buckets[0]["name"].split("/")[1].split(" ")[0])
        assert count >= 3 and names == {f"gradient bucket {i}/{count}" for i in range(1, count + 1)}
        assert len(ready) == len(buckets) and all(e["args"]["bytes"] > 0 for e in buckets)
        # Each bucket was handed over when its gradients existed, and reduced after that.
        for b, r in zip(sorted(buckets, key=lambda e: e["ts"]), sorted(ready, key=lambda e: e["ts"])):
            assert r["ts"] <= b["ts"] and b["name"] + " ready" == r["name"]


@pytest.fixture(scope="module")
def two_ranks(spark, tmp_path_factory):
    outdir = tmp_path_factory.mktemp("buckets2")
    sparktrain.run(engine_thread_and_order, args=(str(outdir),), num_proc=2,
                   env={**ENV, "TF_NUM_INTEROP_THREADS": "1"}, verbose=0)
    return outdir, read_ranks(str(outdir))


def test_tensorflows_only_thread_goes_on_while_a_bucket_waits_for_a_peer(two_ranks):
    outdir, ranks = two_ranks
    # Rank 1 entered the bucket only after rank 0 had run an op beside it...
    assert ranks[1]["saw_marker"] is True
    # ...which rank 0's one inter-op thread ran after it handed the bucket over, before the
    # bucket could finish: the reduction was not on that thread.
    [went_on] = ranks[0]["went_on_at"]
    events = json.loads((outdir / "engine-thread.json").read_text())["traceEvents"]
    first = min((e for e in events if e.get("ph") == "X" and e["tid"] == 1), key=lambda e: e["ts"])
    ready = [e["ts"] for e in events if e.get("name") == first["name"] + " ready"]
    assert ready and ready[0] <= went_on <= first["ts"] + first["dur"]
    # And the sums are right: a = rank + 1 and b = 10 (rank + 1), summed over 2 ranks.
    assert ranks[0]["first"] == ranks[1]["first"] == [3.0, 30.0]


def test_buckets_pair_in_program_order_whatever_order_the_gradients_come(two_ranks):
    _, ranks = two_ranks
    # Rank 1 made the second bucket's gradient first; a bucket paired with the other would mix 3 and 30.
    assert ranks[1]["made"] == ["a", "b"]
    assert ranks[0]["ordered"] == ranks[1]["ordered"] == [3.0, 30.0]


def test_a_mismatched_bucket_is_refused_on_both_ranks_naming_both_shapes(two_ranks):
    _, ranks = two_ranks
    for r in (0, 1):
        message = ranks[r]["mismatch"]
        assert message and message.startswith("FailedPreconditionError"), message
        assert "4096" in message and "8192" in message, message
        assert ranks[r]["after"] == 2.0  # the communicator still works


def test_a_rank_that_dies_while_a_bucket_waits_fails_the_run_naming_it(spark, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as info:
        sparktrain.run(dies_in_a_bucket, args=(str(tmp_path),), num_proc=2, env=ENV, verbose=0)
    failures, root = info.value.failures, info.value.root_cause
    assert failures[1].exitcode == 17, str(info.value)
    # The root cause is rank 1's exit, whichever the driver heard first: rank 0's bucket names rank 1
    # as the peer that died under it.
    assert root.rank == 1, str(info.value)
    assert (tmp_path / "rank0-in-bucket").exists()
