"""The native CPU collective engine against numpy: every op and dtype, sizes 0 to MiBs, 1 to 4
ranks, over shared memory, the forced TCP ring, and both at once (two "hosts" on loopback).

Ranks are plain forked processes (tests/native_ranks.py), not Spark, so this runs in seconds.
"""
from __future__ import annotations

import pytest

from sparktrain import native

import native_ranks as nr

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))]

SIZES = (0, 1, 7, 1024, 1_000_003)


def check_correct(results, n):
    values = nr.all_ok(results, n)
    for r, v in values.items():
        assert v["bad"] == [], (r, v["bad"])
    # Bit-identical on every rank, random inputs included.
    assert len({tuple(sorted(v["digests"].items())) for v in values.values()}) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_matches_numpy_over_shared_memory(n):
    check_correct(nr.run_ranks(n, nr.correctness, SIZES), n)


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_matches_numpy_over_forced_tcp(n):
    check_correct(nr.run_ranks(n, nr.correctness, SIZES, tcp=True), n)


def test_allreduce_hierarchical_two_hosts_of_two():
    # 127.0.0.2 is loopback too: two "hosts", each with its own segment, their leaders on the ring.
    hosts = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    check_correct(nr.run_ranks(4, nr.correctness, SIZES, hosts=hosts), 4)


def test_allreduce_hierarchical_uneven_hosts():
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.1"]
    check_correct(nr.run_ranks(3, nr.correctness, (0, 7, 100_003), ("float32", "int64"), hosts=hosts), 3)


@pytest.mark.parametrize("n", [3])
@pytest.mark.parametrize("tcp", [False, True])
def test_64_mib_allreduce(n, tcp):
    check_correct(nr.run_ranks(n, nr.correctness, (16 << 20,), ("float32",), tcp=tcp), n)


@pytest.mark.parametrize("n, tcp, hosts", [
    (1, False, None), (2, False, None), (3, False, None), (3, True, None),
    (4, False, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]),
])
def test_broadcast_allgather_barrier(n, tcp, hosts):
    import numpy as np

    values = nr.all_ok(nr.run_ranks(n, nr.other_ops, tcp=tcp, hosts=hosts), n)
    for r, v in values.items():
        assert v == values[0], r
        for root in range(n):
            assert v[f"bcast{root}"] == np.full((3, 5), root * 10 + 1).tolist()
            assert v[f"bcast_big{root}"] == nr.digest(np.arange(3_000_001, dtype=np.int32) * (root + 1))
        assert v["gather"] == [[k, k] for k in range(n) for _ in range(k + 1)]
        assert v["gather_empty"] == (2 * ((n + 1) // 2), 3)
        assert v["gather_big"] == nr.digest(np.concatenate([np.arange(1_000_003 + k, dtype=np.float32) + k
                                                            for k in range(n)]))


@pytest.mark.parametrize("tcp", [False, True])
def test_ranks_that_disagree_get_an_error_not_numbers(tcp):
    results = nr.run_ranks(2, nr.mismatched, tcp=tcp, timeout=30)
    assert sorted(results) == [0, 1]
    for r, (status, text) in results.items():
        assert status == "error" and "the shapes differ" in text, (r, text)
