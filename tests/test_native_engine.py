"""The native CPU collective engine against numpy: every op and dtype, sizes 0 to MiBs, 1 to 4
ranks, over shared memory, the forced TCP ring, and both at once (two "hosts" on loopback).

Ranks are plain processes forked by a fork server (tests/native_ranks.py), not Spark, so this runs
in seconds.
"""
from __future__ import annotations

import os
import threading
import warnings

import pytest

from sparktrain import engine

import native_ranks as nr

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]

SIZES = (0, 1, 7, 1024, 1_000_003)


def check_correct(results, n):
    values = nr.all_ok(results, n)
    for r, v in values.items():
        assert v["bad"] == [], (r, v["bad"])
    # Bit-identical on every rank, random inputs included.
    assert len({tuple(sorted(v["digests"].items())) for v in values.values()}) == 1


def test_ranks_start_from_the_fork_server_not_as_forks_of_this_threaded_process():
    """A fork of a threaded process may deadlock in the child, and Python 3.12+ warns at each one
    (a DeprecationWarning it then clears, so an ``error`` filter cannot fail on it: it is recorded
    here). With a thread running in this process, the ranks' parent is the server, and no warning."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, args=(60,), daemon=True)
    thread.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parents = nr.all_ok(nr.run_ranks(2, lambda comm: os.getppid()), 2)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert os.getpid() not in parents.values() and len(set(parents.values())) == 1, (os.getpid(), parents)
    assert [str(w.message) for w in caught if "fork()" in str(w.message)] == []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_matches_numpy_over_shared_memory(n):
    check_correct(nr.run_ranks(n, nr.correctness, SIZES), n)


@pytest.mark.parametrize("n", [2, 3, 4])  # 4: segments of unequal length stream through three hops
def test_allreduce_matches_numpy_over_forced_tcp(n):
    check_correct(nr.run_ranks(n, nr.correctness, SIZES, tcp=True), n)


@pytest.mark.parametrize("n, spin", [(2, 0.0), (3, 0.01)])  # 3 spinning ranks outnumber CI's 2 cores
def test_allreduce_matches_numpy_with_waits_that_spin_or_sleep_at_once(n, spin):
    check_correct(nr.run_ranks(n, nr.correctness, SIZES, spin=spin), n)


def test_waits_spin_by_default_only_where_the_hosts_ranks_have_cores_of_their_own():
    from sparktrain.host import cpus

    cores = cpus.usable_cpus()
    for n in sorted({1, 2, cores, cores + 1} - {0}):
        if n > 4:
            continue
        spins = nr.all_ok(nr.run_ranks(n, lambda comm: comm.spin), n)
        assert set(spins.values()) == {engine.SPIN_S if n <= cores else 0.0}, (n, cores, spins)
    # Two hosts of one rank each: each host's one rank has a core.
    spins = nr.all_ok(nr.run_ranks(2, lambda comm: comm.spin, tcp=True), 2)
    assert set(spins.values()) == {engine.SPIN_S}


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


# Three hosts, their ranks not numbered by host: a ring of three passes blocks on, and each host's
# ranks are not contiguous in rank order.
THREE_HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.3", "127.0.0.2"]


@pytest.mark.parametrize("n, tcp, hosts", [
    (1, False, None), (2, False, None), (3, False, None), (3, True, None),
    (4, False, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]), (5, False, THREE_HOSTS),
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


# -- every op and dtype; reducescatter and alltoall; disagreements --------------------------------

TWO_HOSTS_OF_TWO = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
OP_SIZES = (0, 1, 7, 1024, 1003)  # 4 KiB of float32; 1003 no rank count divides


@pytest.mark.parametrize("n, tcp, hosts", [
    (1, False, None), (2, False, None), (3, False, None), (4, False, None),
    (2, True, None), (3, True, None), (4, True, None), (4, False, TWO_HOSTS_OF_TWO),
], ids=["shm1", "shm2", "shm3", "shm4", "tcp2", "tcp3", "tcp4", "hosts2x2"])
def test_every_op_of_every_dtype_matches_numpy(n, tcp, hosts):
    check_correct(nr.run_ranks(n, nr.every_op, OP_SIZES, tcp=tcp, hosts=hosts), n)


@pytest.mark.parametrize("n, hosts", [(4, TWO_HOSTS_OF_TWO), (5, THREE_HOSTS)], ids=["hosts2x2", "hosts3"])
def test_a_large_allreduce_across_hosts_is_pipelined_and_reduces_in_the_rings_order(n, hosts):
    """From 4 MiB, where a host has more than one rank, the local phases and the ring run in
    segments at once (native/pipeline.c); THREE_HOSTS has a host of one rank, whose leader runs
    each segment's ring itself. Every op of several dtypes against numpy, random floats bit for
    bit against the ring's order, the same bits on every rank."""
    check_correct(nr.run_ranks(n, nr.pipelined, hosts=hosts), n)


@pytest.mark.parametrize("n, tcp, hosts", [
    (1, False, None), (2, False, None), (3, False, None), (4, False, None), (3, True, None),
    (4, False, TWO_HOSTS_OF_TWO), (5, False, THREE_HOSTS),
], ids=["shm1", "shm2", "shm3", "shm4", "tcp3", "hosts2x2", "hosts3"])
def test_reducescatter_and_alltoall_match_numpy(n, tcp, hosts):
    def both(comm):
        return nr.reducescatter_cases(comm) + nr.alltoall_cases(comm)

    values = nr.all_ok(nr.run_ranks(n, both, tcp=tcp, hosts=hosts), n)
    for r, bad in values.items():
        assert bad == [], (r, bad)


def test_allgather_and_alltoall_move_only_the_bytes_they_need_between_hosts():
    """Each host's leader receives over the ring exactly the bytes its host needs, or passes on:
    for allgather every other host's rows once; for alltoall each part only on the links between
    its source's host and its destination's."""
    values = nr.all_ok(nr.run_ranks(len(THREE_HOSTS), nr.ring_traffic, hosts=THREE_HOSTS), len(THREE_HOSTS))
    node = {r: v["node"] for r, v in values.items()}
    m, row = max(node.values()) + 1, 3 * 8  # float64 rows of 3
    for r, v in values.items():
        p = v["node"]
        if not v["leader"]:
            assert (v["gather"], v["a2a"]) == (0, 0), (r, v)
            continue
        gather = sum((1000 + 100 * k) * row for k in values if node[k] != p)
        passes = lambda s, g: 1 <= (p - s) % m <= (g - s) % m  # noqa: E731 - p lies on the path from s to g
        a2a = sum(values[i]["splits"][j] * row for i in values for j in values if passes(node[i], node[j]))
        assert (v["gather"], v["a2a"]) == (gather, a2a), (r, p)


# What each disagreement's message must say.
SAYS = {"shape": "the shapes differ", "dtype": "the dtypes differ", "op": "the ops differ",
        "root": "the roots differ", "kind": "the collectives differ", "big shape": "the shapes differ",
        "many dims": "the shapes differ", "reducescatter": "reducescatter: rank",
        "allgather": "only the first dimension may differ", "alltoall splits": "sum to",
        "alltoall dtype": "the dtypes differ", "barrier": "the collectives differ"}


@pytest.mark.parametrize("n, deviants, tcp, hosts", [
    (2, {1}, False, None), (3, {2}, False, None), (3, {0}, True, None), (3, {1}, True, None),
    (4, {3}, False, TWO_HOSTS_OF_TWO),      # a disagreement within the second host
    (4, {2, 3}, False, TWO_HOSTS_OF_TWO),   # the second host against the first: the ring finds it
    (4, {1}, False, TWO_HOSTS_OF_TWO),      # a non-leader of the first host
    (3, {1}, False, ["127.0.0.1", "127.0.0.2", "127.0.0.1"]),
], ids=["shm2", "shm3", "tcp3-leader0", "tcp3", "hosts-within", "hosts-between", "hosts-first", "hosts-uneven"])
def test_a_disagreement_is_the_same_error_on_every_rank_and_the_communicator_goes_on(n, deviants, tcp, hosts):
    values = nr.all_ok(nr.run_ranks(n, nr.disagreements, deviants, tcp=tcp, hosts=hosts, timeout=30), n)
    for r, v in values.items():
        assert v == values[0], (r, v, values[0])  # the same message on every rank, word for word
    v = values[0]
    for label, says in SAYS.items():
        code, text = v[label]
        assert code == engine.MISMATCH, (label, v[label])
        assert says in text, (label, text)
        assert any(f"rank {d}" in text for d in deviants), (label, text)
        assert v[label + " then"] == [float(n)] * 3, (label, v[label + " then"])
    assert "float32[3,4] (op sum)" in v["shape"][1] and "float32[5] (op sum)" in v["shape"][1], v["shape"]


def test_a_bad_op_or_dtype_is_refused_before_the_call_naming_the_choices():
    import numpy as np

    with engine.Communicator(0, 1, ["127.0.0.1"], [0], b"k", "refuse") as comm:
        with pytest.raises(engine.CollectiveError, match=r"op must be one of sum, average, min, max, product; "
                                                         r"got 'mean'"):
            comm.allreduce(np.ones(3, np.float32), "mean")
        with pytest.raises(engine.CollectiveError, match=r"reduces float16, .*bool; got dtype complex64"):
            comm.allreduce(np.ones(3, np.complex64), "sum")
        with pytest.raises(engine.CollectiveError, match="bool has no average"):
            comm.reducescatter(np.ones(3, bool), "average")
        with pytest.raises(engine.CollectiveError, match="op must be one of"):
            comm.allreduce_(np.ones(3, np.float32), None)
        # None of that reached the engine: the communicator works.
        assert comm.allreduce(np.ones(3, bool), "sum").tolist() == [True] * 3
        assert comm.broadcast(np.ones(2, np.complex64)).tolist() == [1, 1]  # moved as opaque bytes
        assert comm.allgather(np.array(["ab", "c"])).tolist() == ["ab", "c"]
    assert engine.OPS == ("sum", "average", "min", "max", "product")
    assert set(engine.DTYPES) >= {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
                                  "uint8", "uint16", "bool"}
