"""Unit tests of the env contract: pure functions, no Spark."""
import json

import pytest

from sparktrain.executor.rankenv import build_worker_env
from sparktrain.host.gpus import NO_GPU, translate_gpu_ids
from sparktrain.seam import topology as topo_room, worker_env as we


def test_topology_single_host():
    got = [topo_room.topology(["h"] * 3, r) for r in range(3)]
    assert [t["local_rank"] for t in got] == [0, 1, 2]
    assert {t["local_size"] for t in got} == {3}
    assert {(t["cross_rank"], t["cross_size"]) for t in got} == {(0, 1)}


def test_topology_two_hosts_uneven():
    hosts = ["a", "b", "a", "b", "a"]
    got = [topo_room.topology(hosts, r) for r in range(5)]
    assert [t["local_rank"] for t in got] == [0, 0, 1, 1, 2]
    assert [t["local_size"] for t in got] == [3, 2, 3, 2, 3]
    # local_rank 2 exists only on host a: one host in that cross group.
    assert [(t["cross_rank"], t["cross_size"]) for t in got] == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 1)]


@pytest.mark.parametrize("hosts, expected", [
    (["a", "b", "a", "b"], [0, 2, 1, 3]),
    (["b", "a", "a", "b", "c"], [0, 2, 3, 1, 4]),
    (["a", "a", "a"], [0, 1, 2]),
    ([], []),
])
def test_ranks_by_host_are_contiguous_per_host(hosts, expected):
    ranks = topo_room.ranks_by_host(hosts)
    assert ranks == expected
    by_rank = [None] * len(hosts)
    for partition, rank in enumerate(ranks):
        by_rank[rank] = hosts[partition]
    # Horovod's rule: a host's ranks form one block, and every rank's topology agrees with it.
    for rank, host in enumerate(by_rank):
        topo = topo_room.topology(by_rank, rank)
        first = by_rank.index(host)
        assert topo["local_rank"] == rank - first
        assert by_rank[first:first + topo["local_size"]] == [host] * topo["local_size"]


def test_topology_rejects_rank_outside():
    with pytest.raises(ValueError, match="rank 3"):
        topo_room.topology(["a", "b"], 3)


@pytest.mark.parametrize("addresses, visible, expected", [
    (["0"], None, "0"),
    (["2"], "", "2"),
    (["1"], "4,5,6", "5"),
    (["0", "2"], "7, 8, 9", "7,9"),
    ([], "0,1", NO_GPU),
    ([], None, NO_GPU),
])
def test_translate_gpu_ids(addresses, visible, expected):
    assert translate_gpu_ids(addresses, visible) == expected


def test_translate_gpu_ids_outside_mask_names_the_value():
    with pytest.raises(ValueError, match=r"'3'.*CUDA_VISIBLE_DEVICES='0,1'"):
        translate_gpu_ids(["3"], "0,1")


def _env(rank=1, **kw):
    args = dict(rank=rank, hosts=["h0", "h0", "h1"], ports=[5000, 5001, 6000], master_port=5999,
                gpu_ids="-1", run_id="abc")
    args.update(kw)
    return build_worker_env(**args)


def test_build_worker_env_contract():
    env = _env(rank=2)
    assert env["SPARKTRAIN_RANK"] == "2" and env["SPARKTRAIN_SIZE"] == "3"
    assert env["SPARKTRAIN_LOCAL_RANK"] == "0" and env["SPARKTRAIN_LOCAL_SIZE"] == "1"
    assert env["SPARKTRAIN_CROSS_RANK"] == "1" and env["SPARKTRAIN_CROSS_SIZE"] == "2"
    assert env["SPARKTRAIN_RUN_ID"] == "abc"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "3", "0", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("h0", "5999")
    assert env["CUDA_VISIBLE_DEVICES"] == "-1"
    tf_config = json.loads(env["TF_CONFIG"])
    assert tf_config == {"cluster": {"worker": ["h0:5000", "h0:5001", "h1:6000"]},
                         "task": {"type": "worker", "index": 2}}
    assert all(isinstance(v, str) for v in env.values())


def test_build_worker_env_user_env_kept_but_cannot_override_contract():
    env = _env(user_env={"MY_FLAG": "1", "PYTHONUNBUFFERED": "0"})
    assert env["MY_FLAG"] == "1"
    assert env["PYTHONUNBUFFERED"] == "0"  # a user's choice, not part of the contract


def test_build_worker_env_mismatched_lengths():
    with pytest.raises(ValueError, match="3 hosts but 2 ports"):
        _env(ports=[1, 2])


def test_reserved_vars_cover_every_contract_name():
    env = _env()
    contract = {k for k in env if k not in ("PYTHONUNBUFFERED",)}
    assert contract <= we.RESERVED_VARS
