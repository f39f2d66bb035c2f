"""Horovod's rank numbering: which rank each barrier task is, and each rank's place among the
ranks of its host and across the hosts.

Pure functions: every task computes the same numbers from the same list of hosts, with no
message between them.
"""
from __future__ import annotations

from typing import Sequence


def topology(hosts: Sequence[str], rank: int) -> dict[str, int]:
    """Horovod's topology numbers for ``rank`` given every rank's host, in rank order.

    ``local_rank`` counts the ranks before this one on the same host. ``cross_rank`` is the
    index of this host among the hosts that run a process with the same ``local_rank``, and
    ``cross_size`` is how many such hosts there are.

    >>> topology(["a", "a", "b"], 2)
    {'rank': 2, 'size': 3, 'local_rank': 0, 'local_size': 1, 'cross_rank': 1, 'cross_size': 2}
    """
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside 0..{len(hosts) - 1}")
    host = hosts[rank]
    local_rank = sum(1 for h in hosts[:rank] if h == host)
    local_size = sum(1 for h in hosts if h == host)
    # The hosts that have a process with this local_rank, in order of first appearance.
    seen: dict[str, int] = {}
    peers: list[str] = []
    for h in hosts:
        seen[h] = seen.get(h, -1) + 1
        if seen[h] == local_rank:
            peers.append(h)
    return {
        "rank": rank,
        "size": len(hosts),
        "local_rank": local_rank,
        "local_size": local_size,
        "cross_rank": peers.index(host),
        "cross_size": len(peers),
    }


def ranks_by_host(task_hosts: Sequence[str]) -> list[int]:
    """Each barrier task's rank, given every task's host in partition order (Horovod's numbering).

    Hosts come in the order of their first task; within a host, ranks are contiguous and follow
    the tasks' order. So the first ``local_size`` ranks share a machine, and on hosts that run
    the same number of ranks ``local_rank == rank % local_size``. Every task computes the same
    list from ``BarrierTaskContext.getTaskInfos()``, with no message between them.

    >>> ranks_by_host(["a", "b", "a", "b"])
    [0, 2, 1, 3]
    """
    order: dict[str, list[int]] = {}
    for partition, host in enumerate(task_hosts):
        order.setdefault(host, []).append(partition)
    ranks = [0] * len(task_hosts)
    for rank, partition in enumerate(p for partitions in order.values() for p in partitions):
        ranks[partition] = rank
    return ranks
