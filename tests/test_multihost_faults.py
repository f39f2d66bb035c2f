"""The multi-host tier, faults between hosts: a silent partition, a link that flaps or is slow, a
link cut for 5 s under channel connections reset meanwhile, a host that dies (the cluster:
tests/multihost_cluster.py)."""
from __future__ import annotations

import os
import re
import time

import pytest

from helpers import rank_processes
from multihost_cluster import HOSTS, MARKS, PER_HOST, fail_by, ranks_on, run_id_of, when_running, work_dirs

import sparktrain

pytestmark = MARKS


@pytest.mark.timeout(300)
def test_a_silent_partition_fails_the_run_naming_the_host_and_its_ranks_stop(cluster, tmp_path):
    """One host's link goes down for good while the ranks allreduce across hosts: no reset reaches
    anyone. The driver fails the run naming that host as unreachable (not the run's 90 s timeout,
    nor Spark's executor heartbeat, which is 120 s), and the cut-off host's ranks stop by
    themselves. Then the link comes back, and nothing of the run is left on any host."""
    from helpers import fault_time

    hosts, standalone, _ = cluster
    n = HOSTS * PER_HOST
    try:
        error, cut_at, failed_at = fail_by(tmp_path, n, lambda: hosts.cut(1))
        root = error.root_cause
        assert root.exc_type == "HostUnreachable", error
        assert f"host {hosts.ips[1]} became unreachable" in root.message, root
        assert root.host == hosts.ips[1] and root.rank in ranks_on(tmp_path, hosts.names[1]), root
        fault_time("silent partition", 15.0, failed_at - cut_at)
        # The cut-off host's ranks stop by themselves: nobody can reach them to tell them.
        assert rank_processes(f"sparktrain-{run_id_of(tmp_path)}-", timeout=60) == []
    finally:
        hosts.heal(1)
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if name.startswith("sparktrain-")] == []


def allreduce_through(outdir, more):
    """Allreduces across the hosts, each checked, until ``more`` rounds after rank 0 has seen the
    file ``healed`` (the last element carries its word to everyone, so all stop alike); says when it
    is under way. Returns the rounds it made."""
    return _rounds_through(outdir, more, 250_001, printing=False)


def _rounds_through(outdir, more, width, printing):
    """``allreduce_through``'s rounds of ``width`` float64 each; ``printing``: a line each round, and
    each rank's host written beside its mark."""
    import socket

    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    n, r = comm.size, comm.rank
    i = after = 0
    while True:
        x = np.full(width, r + i, np.float64)
        x[-1] = float(r == 0 and os.path.exists(os.path.join(outdir, "healed")))
        got = comm.allreduce(x, "sum")
        if not (got[:-1] == sum(k + i for k in range(n))).all():
            raise AssertionError(f"round {i}: wrong sum {got[:3]}")
        if printing:
            print(f"rank {r} round {i}", flush=True)
        if i == 1:
            if printing:
                with open(os.path.join(outdir, f"host-{r}"), "w") as f:
                    f.write(socket.gethostname())
            mark_time(outdir, f"running-{r}")
        i += 1
        if got[-1] > 0:
            after += 1
            if after >= more:
                return i


@pytest.mark.timeout(240)
def test_a_link_that_flaps_or_is_slow_does_not_fail_the_run(cluster, tmp_path):
    """A host's link down for 2 s, then up, while the ranks allreduce across hosts: shorter than
    heartbeat_timeout, so the run goes on and every sum is right. Then every link shaped to
    100 Mbit/s: the run is slower, and right."""
    hosts, _, _ = cluster
    n = HOSTS * PER_HOST

    def flap():
        hosts.cut(1)
        time.sleep(2.0)  # the outage itself: a link down for 2 s
        hosts.heal(1)
        (tmp_path / "healed").touch()

    flapper, _ = when_running(tmp_path, n, flap)
    try:
        rounds = sparktrain.run(allreduce_through, args=(str(tmp_path), 20), num_proc=n, timeout=120, verbose=0)
        assert rounds > 20 and (tmp_path / "healed").exists()
    finally:
        flapper.join(10)
        hosts.heal(1)
    try:
        hosts.shape_all("100mbit")
        assert sparktrain.run(allreduce_through, args=(str(tmp_path), 10), num_proc=n, timeout=120, verbose=0) >= 10
    finally:
        hosts.shape_all("none")


def print_rounds_through(outdir, more):
    """Allreduces across the hosts as ``allreduce_through`` does, and prints a line each round;
    returns the rounds it made (every rank makes as many)."""
    return _rounds_through(outdir, more, 1001, printing=True)


@pytest.mark.timeout(300)
def test_a_silent_partition_fails_the_run_naming_the_host_and_its_ranks_stop(cluster, tmp_path):
    """One host's link goes down for good while the ranks allreduce across hosts: no reset reaches
    anyone. The driver fails the run naming that host as unreachable (not the run's 90 s timeout,
    nor Spark's executor heartbeat, which is 120 s), and the cut-off host's ranks stop by
    themselves. Then the link comes back, and nothing of the run is left on any host."""
    from helpers import fault_time

    hosts, standalone, _ = cluster
    n = HOSTS * PER_HOST
    try:
        error, cut_at, failed_at = fail_by(tmp_path, n, lambda: hosts.cut(1))
        root = error.root_cause
        assert root.exc_type == "HostUnreachable", error
        assert f"host {hosts.ips[1]} became unreachable" in root.message, root
        assert root.host == hosts.ips[1] and root.rank in ranks_on(tmp_path, hosts.names[1]), root
        fault_time("silent partition", 15.0, failed_at - cut_at)
        # The cut-off host's ranks stop by themselves: nobody can reach them to tell them.
        assert rank_processes(f"sparktrain-{run_id_of(tmp_path)}-", timeout=60) == []
    finally:
        hosts.heal(1)
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if name.startswith("sparktrain-")] == []


def allreduce_through(outdir, more):
    """Allreduces across the hosts, each checked, until ``more`` rounds after rank 0 has seen the
    file ``healed`` (the last element carries its word to everyone, so all stop alike); says when it
    is under way. Returns the rounds it made."""
    return _rounds_through(outdir, more, 250_001, printing=False)


def _rounds_through(outdir, more, width, printing):
    """``allreduce_through``'s rounds of ``width`` float64 each; ``printing``: a line each round, and
    each rank's host written beside its mark."""
    import socket

    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    n, r = comm.size, comm.rank
    i = after = 0
    while True:
        x = np.full(width, r + i, np.float64)
        x[-1] = float(r == 0 and os.path.exists(os.path.join(outdir, "healed")))
        got = comm.allreduce(x, "sum")
        if not (got[:-1] == sum(k + i for k in range(n))).all():
            raise AssertionError(f"round {i}: wrong sum {got[:3]}")
        if printing:
            print(f"rank {r} round {i}", flush=True)
        if i == 1:
            if printing:
                with open(os.path.join(outdir, f"host-{r}"), "w") as f:
                    f.write(socket.gethostname())
            mark_time(outdir, f"running-{r}")
        i += 1
        if got[-1] > 0:
            after += 1
            if after >= more:
                return i


@pytest.mark.timeout(240)
def test_a_link_that_flaps_or_is_slow_does_not_fail_the_run(cluster, tmp_path):
    """A host's link down for 2 s, then up, while the ranks allreduce across hosts: shorter than
    heartbeat_timeout, so the run goes on and every sum is right. Then every link shaped to
    100 Mbit/s: the run is slower, and right."""
    hosts, _, _ = cluster
    n = HOSTS * PER_HOST

    def flap():
        hosts.cut(1)
        time.sleep(2.0)  # the outage itself: a link down for 2 s
        hosts.heal(1)
        (tmp_path / "healed").touch()

    flapper, _ = when_running(tmp_path, n, flap)
    try:
        rounds = sparktrain.run(allreduce_through, args=(str(tmp_path), 20), num_proc=n, timeout=120, verbose=0)
        assert rounds > 20 and (tmp_path / "healed").exists()
    finally:
        flapper.join(10)
        hosts.heal(1)
    try:
        hosts.shape_all("100mbit")
        assert sparktrain.run(allreduce_through, args=(str(tmp_path), 10), num_proc=n, timeout=120, verbose=0) >= 10
    finally:
        hosts.shape_all("none")


def print_rounds_through(outdir, more):
    """Allreduces across the hosts as ``allreduce_through`` does, and prints a line each round;
    returns the rounds it made (every rank makes as many)."""
    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    i = after = 0
    while True:
        x = np.zeros(1001)
        x[-1] = float(comm.rank == 0 and os.path.exists(os.path.join(outdir, "healed")))
        got = comm.allreduce(x, "sum")
        print(f"rank {comm.rank} round {i}", flush=True)
        if i == 1:
            with open(os.path.join(outdir, f"host-{comm.rank}"), "w") as f:
                import socket

                f.write(socket.gethostname())
            mark_time(outdir, f"running-{comm.rank}")
        i += 1
        if got[-1] > 0:
            after += 1
            if after >= more:
                return i


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reset", [True, False], ids=["channel reset", "link cut only"])
def test_a_link_cut_for_5_s_loses_no_line(cluster, tmp_path, caplog, reset):
    """Host 1's link goes down for 5 s while the ranks allreduce and print. With ``reset``, the
    driver's end of every rank's channel connection is destroyed meanwhile (``ss -K``, as a
    middlebox that drops the flows; the resets to host 1 are lost on the cut link): host 0's ranks
    reconnect at once, host 1's once the link is back, within heartbeat_timeout, and each rank's
    channel is said to have come back once. Without, host 1's ranks find the driver silent and
    reconnect, or their connections carry on once the link is back. Either way the run goes on,
    every line of every rank reaches the driver once and in order, and nothing of the run is left
    on any host."""
    import io
    import logging

    import resets

    if reset and resets.why_not() is not None:
        pytest.skip(resets.why_not())
    caplog.set_level(logging.WARNING, logger="sparktrain")
    hosts, standalone, _ = cluster
    n = HOSTS * PER_HOST
    before, found = resets.listening_ports(), {}

    def cut_and_reset():
        hosts.cut(1)
        try:
            (port,) = resets.listening_ports() - before  # the run's channel
            found["killed"] = resets.reset(resets.listening_address(port)) if reset else []
            time.sleep(5.0)  # the outage itself: a link down for 5 s
        finally:
            hosts.heal(1)
            (tmp_path / "healed").touch()

    cutter, _ = when_running(tmp_path, n, cut_and_reset)
    out = io.StringIO()
    try:
        rounds = sparktrain.run(print_rounds_through, args=(str(tmp_path), 20), num_proc=n, timeout=150,
                                stdout=out, stderr=out, verbose=0)
    finally:
        cutter.join(30)
        hosts.heal(1)
    assert rounds > 20 and len(found["killed"]) >= (n if reset else 0), found
    for r in range(n):
        prefix = f"[{r}]<stdout>:"
        lines = [line[len(prefix):] for line in out.getvalue().splitlines() if line.startswith(prefix)]
        assert lines == [f"rank {r} round {i}" for i in range(rounds)], (r, out.getvalue()[-3000:])
        came_back = caplog.text.count(f"rank {r}'s channel to the driver dropped and came back after")
        assert (came_back == 1) if reset else (came_back <= 1), caplog.text
    assert set(ranks_on(tmp_path, hosts.names[1])) and "HostUnreachable" not in caplog.text
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if name.startswith("sparktrain-")] == []


@pytest.mark.timeout(300)
def test_a_host_that_dies_fails_the_run_naming_it(cluster, tmp_path):
    """Every process of one host is killed (its worker, executor, tasks and ranks) while the ranks
    allreduce across hosts. The run fails naming a rank of that host, and nothing of the run is left
    on the other host. The worker then starts again, for whatever runs next on the cluster."""
    from helpers import fault_time
    from sparktrain.driver.launch import cluster as capacity

    hosts, standalone, session = cluster
    n = HOSTS * PER_HOST
    try:
        error, killed_at, failed_at = fail_by(tmp_path, n, lambda: hosts.kill_host(1))
        fault_time("host killed", 15.0, failed_at - killed_at)
        root = error.root_cause
        dead = ranks_on(tmp_path, hosts.names[1])
        # The first to tell may be a rank of the dead host (its task lost) or a peer whose ring
        # connection to it closed: either way a rank of that host is named.
        assert (root.host == hosts.ips[1] and root.rank in dead) or \
            any(f"rank {r} died" in root.message for r in dead), error
        assert rank_processes(f"sparktrain-{run_id_of(tmp_path)}-", timeout=30) == []
        assert [name for name in hosts.shm(0, standalone.workers[0].pid) if name.startswith("sparktrain-")] == []
        # The dead host's watchers died with it: its ranks' directories, collective key and all,
        # are still on its disk (the other host's tasks removed theirs).
        left = work_dirs(run_id_of(tmp_path))
        assert left and all(int(re.search(r"-r(\d+)-", d).group(1)) in dead for d in left), (left, dead)
    finally:
        standalone.start_worker(1)
        conf = dict(session.sparkContext.getConf().getAll())
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)
    # The next run's ranks sweep them away as they start.
    assert sparktrain.run(os.getpid, num_proc=n, verbose=0) > 0
    assert work_dirs(run_id_of(tmp_path)) == []
