"""Gradient buckets on Keras 3 with JAX (sparktrain._jax.collectives): each bucket an asynchronous XLA
FFI custom call that the engine's thread reduces while the step goes on, on a real local[3] Spark:
the same bits as the fused reduction on 3 and 2 ranks for DistributedOptimizer (with fp16
compression, predivision, Sum and two backward passes); XLA running a callback beside a bucket that
waits for a peer; the buckets in program order when one rank's arrays come in another order; a
mismatch refused naming both shapes; a rank that dies while a bucket waits failing the run by name."""
from __future__ import annotations

import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks, skip_without_jax

skip_without_jax()
pytestmark = [pytest.mark.timeout(300), pytest.mark.jax]

from jax_overlap_ranks import dies_in_a_bucket, engine_thread_and_order, fused_against_buckets  # noqa: E402
from overlap_ranks import FIT_VARIANTS  # noqa: E402

spark = module_spark("local[3]")
ENV = {"SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}


@pytest.mark.parametrize("ranks", [3, 2])
def test_buckets_give_the_fused_reductions_bits(spark, tmp_path, ranks):
    sparktrain.run(fused_against_buckets, args=(str(tmp_path),), num_proc=ranks, backend="jax", env=ENV,
                   verbose=0)
    results = read_ranks(str(tmp_path))
    assert sorted(results) == list(range(ranks))
    for name in FIT_VARIANTS:
        fused, bucketed = results[0]["digests"][name]
        assert fused == bucketed, name
        assert {info["digests"][name][1] for info in results.values()} == {bucketed}, name  # every rank's bits
    # The variants train differently, so a digest that ignored its inputs could not pass.
    assert len({results[0]["digests"][name][0] for name in FIT_VARIANTS}) == len(FIT_VARIANTS)
    for info in results.values():
        # The fused fits started no engine thread; the bucketed ones handed their buckets to it.
        assert "sparktrain-grad" not in info["threads_fused"]
        assert {"sparktrain-grad", "sparktrain-done"} <= set(info["threads"])


@pytest.fixture(scope="module")
def two_ranks(spark, tmp_path_factory):
    outdir = tmp_path_factory.mktemp("jaxbuckets2")
    sparktrain.run(engine_thread_and_order, args=(str(outdir),), num_proc=2, backend="jax", env=ENV, verbose=0)
    return outdir, read_ranks(str(outdir))


def test_xla_goes_on_beside_a_bucket_that_waits_for_a_peer(two_ranks):
    _, ranks = two_ranks
    # Rank 1 entered the bucket only after rank 0's step had run the callback beside it...
    assert ranks[1]["saw_marker"] is True
    # ...which rank 0's XLA ran during that step, while its bucket waited: not on XLA's thread.
    [went_on] = ranks[0]["went_on_at"]
    assert ranks[0]["started"] <= went_on <= ranks[0]["finished"]
    # And the sums are right: a = rank + 1 and b = 10 (rank + 1), summed over 2 ranks.
    assert ranks[0]["first"] == ranks[1]["first"] == [3.0, 30.0]
    assert all("sparktrain-grad" in info["threads"] for info in ranks.values())


def test_buckets_pair_in_program_order_whatever_order_the_arrays_come(two_ranks):
    _, ranks = two_ranks
    # Rank 1 made the first bucket's array last, rank 0 first; a bucket paired with the other would
    # mix 3 and 30.
    assert ranks[0]["ordered"] == ranks[1]["ordered"] == [3.0, 30.0]


def test_a_mismatched_bucket_is_refused_on_both_ranks_naming_both_shapes(two_ranks):
    _, ranks = two_ranks
    for r in (0, 1):
        message = ranks[r]["mismatch"]
        assert message and "FAILED_PRECONDITION" in message, message
        assert "4096" in message and "8192" in message, message
        assert ranks[r]["after"] == [1.5]  # the communicator still works


def test_a_rank_that_dies_while_a_bucket_waits_fails_the_run_naming_it(spark, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as info:
        sparktrain.run(dies_in_a_bucket, args=(str(tmp_path),), num_proc=2, backend="jax", env=ENV, verbose=0)
    failures = info.value.failures
    assert failures[1].exitcode == 17, str(info.value)
    # Rank 0's bucket failed naming the rank that died (whichever of the two reports first is the
    # run's root cause).
    assert "UNAVAILABLE" in failures[0].message and "rank 1" in failures[0].message, str(info.value)
    assert (tmp_path / "rank0-in-bucket").exists()
