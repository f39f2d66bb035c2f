"""The multi-host tier on 8 simulated hosts of 2 slots each (16 ranks, on this machine's cores):
placement by host, an allreduce across the 8 hosts, a silent partition of one host, a stall of one
late rank of 16 and ``run_elastic`` losing one host of 8, and a Keras fit from a DataFrame on 16
ranks. The cluster is started once for the module (tests/multihost_cluster.py, ``cluster8``).
The whole module is in the slow multi-host tier (``-m "multihost and slow" -n 0``, by hand: about
180 s on 2 cores, 30 s of it the cluster's start), which keeps CI's multi-host tier within its
share of the budget; only the Keras fit imports TensorFlow (16 imports on 2 cores)."""
from __future__ import annotations

import glob
import logging
import os
import re

import pytest

from helpers import fault_time, rank_processes, read_ranks
from multihost_cluster import MARKS, fail_by, ranks_on, run_id_of, when_running, work_dirs

import sparktrain

pytestmark = [*MARKS, pytest.mark.slow]

HOSTS, PER_HOST = 8, 2
N = HOSTS * PER_HOST


def wait_for_slots(session, slots: int) -> None:
    """Every host's executor is back (after a cut healed, or a worker restarted)."""
    from sparktrain.driver.launch import cluster as capacity

    conf = dict(session.sparkContext.getConf().getAll())
    found = capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.slots(False) >= slots, 120)
    assert found.slots(False) >= slots, found


def nothing_left(hosts, standalone, run_id: str) -> None:
    """No process of the run on any host, nothing of it in any host's /dev/shm or Spark local dir."""
    assert rank_processes(f"sparktrain-{run_id}-", timeout=30) == []
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if run_id in name] == [], i
        assert glob.glob(os.path.join(hosts.home(i), "local", "**", f"sparktrain-{run_id}-*"), recursive=True) == []


def sums_across_hosts(outdir):
    """An allreduce of exact integers across the hosts, small (one after the other) and 4 MiB (the
    host's phases and the ring pipelined); what each rank got, and where it ran."""
    import hashlib
    import socket

    import numpy as np

    from helpers import record_rank
    from sparktrain import engine

    comm = engine.from_env()
    r, n = comm.rank, comm.size
    got = {}
    for count in (1_001, 1_048_583):
        mine = ((np.arange(count, dtype=np.int64) * 7 + r * 3) % 11 - 5).astype(np.float32)
        total = comm.allreduce(mine, "sum")
        want = sum(((np.arange(count, dtype=np.int64) * 7 + k * 3) % 11 - 5) for k in range(n)).astype(np.float32)
        got[count] = {"right": bool((total == want).all()), "digest": hashlib.sha256(total.tobytes()).hexdigest()}
    record_rank(outdir, hostname=socket.gethostname(), node=comm.node, engine_local_rank=comm.local_rank,
                transport=comm.transport, sums=got)
    comm.close()
    return r


@pytest.mark.timeout(300)
def test_16_ranks_are_placed_by_host_and_an_allreduce_across_8_hosts_is_exact(cluster8, tmp_path):
    hosts, standalone, _ = cluster8
    assert sparktrain.run(sums_across_hosts, args=(str(tmp_path),), num_proc=N, timeout=240, verbose=0) == 0
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == list(range(N))
    by_host: dict[str, list[int]] = {}
    for r, info in sorted(ranks.items()):
        by_host.setdefault(info["hostname"], []).append(r)
    # PER_HOST ranks on every host, numbered host by host.
    assert set(by_host) == set(hosts.names), by_host
    assert sorted(by_host.values()) == [list(range(h * PER_HOST, (h + 1) * PER_HOST)) for h in range(HOSTS)]
    for r, info in ranks.items():
        assert (info["local_rank"], info["local_size"]) == (r % PER_HOST, PER_HOST), info
        assert (info["cross_rank"], info["cross_size"]) == (r // PER_HOST, HOSTS), info
        assert (info["node"], info["engine_local_rank"]) == (info["cross_rank"], info["local_rank"]), info
        assert info["transport"] == "shm+tcp", info
        for count, got in info["sums"].items():
            # The sum is numpy's, and the same bits on every rank.
            assert got["right"] and got["digest"] == ranks[0]["sums"][count]["digest"], (r, count)
    nothing_left(hosts, standalone, ranks[0]["env"]["SPARKTRAIN_RUN_ID"])


@pytest.mark.timeout(300)
def test_a_silent_partition_of_one_host_of_8_fails_the_run_naming_it(cluster8, tmp_path):
    """Host 5's link goes down for good while 16 ranks allreduce across 8 hosts. The driver fails
    the run naming host 5 as unreachable and a rank of it; the cut-off ranks stop by themselves,
    and once the link is back nothing of the run is left on any host."""
    hosts, standalone, session = cluster8
    cut = 5
    try:
        error, cut_at, failed_at = fail_by(tmp_path, N, lambda: hosts.cut(cut))
        root = error.root_cause
        assert root.exc_type == "HostUnreachable", error
        assert f"host {hosts.ips[cut]} became unreachable" in root.message, root
        assert root.host == hosts.ips[cut] and root.rank in ranks_on(tmp_path, hosts.names[cut], N), root
        first = ranks_on(tmp_path, hosts.names[cut], N)[0]
        assert ranks_on(tmp_path, hosts.names[cut], N) == [first, first + 1] and first % PER_HOST == 0
        fault_time("silent partition, 1 host of 8", 15.0, failed_at - cut_at)
        print(f"partition noticed {failed_at - cut_at:.1f} s after the cut")
        assert rank_processes(f"sparktrain-{run_id_of(tmp_path)}-", timeout=60) == []
    finally:
        hosts.heal(cut)
    wait_for_slots(session, N)
    nothing_left(hosts, standalone, run_id_of(tmp_path))
    assert work_dirs(run_id_of(tmp_path)) == []


@pytest.mark.timeout(240)
def test_a_stall_report_names_the_one_late_rank_of_16(cluster8, tmp_path):
    """stall_warning=10: rank 13 (its host's second) waits in user code before an allreduce the other 15 are
    in. One report names rank 13 and its host, with its stack down to the user's line, and lists
    the 15 waiting ranks; the run goes on once the late rank is let go."""
    from test_stalls import _late_line, one_stall_report

    hosts, _, _ = cluster8
    late = 13
    report, seconds = one_stall_report(str(tmp_path), late, num_proc=N, stall_warning=10, timeout=200)
    head = re.search(rf"stall: ranks (.*) have waited \d+ s in allreduce #2 \(float32\[8,3\], sum\); "
                     rf"rank {late} has not arrived$", report.splitlines()[0])
    assert head, report
    waiting = dict(re.findall(r"(\d+) \((\S+)\)", head.group(1)))
    assert sorted(map(int, waiting)) == [r for r in range(N) if r != late], report
    # Ranks are numbered by host: the late rank's host is its partner's, and every other host has both.
    host = waiting[str(late - 1)]
    counts = {ip: list(waiting.values()).count(ip) for ip in hosts.ips}
    assert counts == {ip: PER_HOST - (ip == host) for ip in hosts.ips}, report
    assert f"rank {late} ({host}) is after allreduce #1" in report, report
    assert f"line {_late_line()} in late_rank" in report, report
    assert len(re.findall(r"^  rank \d+ ", report, re.M)) == 1, report  # only the late rank's stack
    fault_time("stall report, 1 late rank of 16 on 8 hosts, stall_warning=10 s", 20, seconds)
    print(f"stall report {seconds:.1f} s after the stall began")


def rounds_from_commit(outdir, rounds, commit_at):
    """Allreduces across the hosts, checked, from the round of the test's own last commit (rank 0
    reads it and broadcasts it: hvd.elastic's state would need TensorFlow). The first attempt
    commits at round ``commit_at``, says it runs, and goes on until a host is lost; a later one
    finishes ``rounds``. Rank 0 returns the round it resumed from."""
    import json
    import socket

    import numpy as np

    from helpers import mark_time, record_rank
    from sparktrain import engine

    comm = engine.from_env()
    r, n = comm.rank, comm.size
    path = os.path.join(outdir, "commit.json")
    start = np.zeros(1, np.int64)
    if r == 0 and os.path.exists(path):
        with open(path) as f:
            start[0] = json.load(f)["round"]
    start = int(comm.broadcast(start, 0)[0])
    record_rank(outdir, tag=f"-from{start}", hostname=socket.gethostname(), start=start)
    i, first = start, start == 0
    while first or i < rounds:
        got = comm.allreduce(np.full(10_000, i + 1.0), "sum")
        if not (got == n * (i + 1.0)).all():
            raise AssertionError(f"round {i}: {got[:3]}")
        i += 1
        if first and i == commit_at:
            if r == 0:
                with open(path + ".tmp", "w") as f:
                    json.dump({"round": i}, f)
                os.replace(path + ".tmp", path)
            comm.barrier()  # the commit is down before anyone says it runs
            mark_time(outdir, f"running-{r}")
    comm.close()
    return start


@pytest.mark.timeout(420)
def test_run_elastic_loses_one_host_of_8_and_finishes_on_the_other_7(cluster8, tmp_path, caplog):
    """run_elastic of 16 ranks: host 7 dies whole (worker, executor, ranks) after the first
    attempt's commit. The run goes on with the other 7 hosts' 14 ranks, resumed from that commit,
    placed by host, and finishes; nothing of either attempt is left on the live hosts."""
    hosts, standalone, session = cluster8
    dead, commit_at = 7, 20
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    caplog.set_level(logging.INFO, logger="sparktrain")
    thread, _ = when_running(tmp_path, N, lambda: hosts.kill_host(dead))
    try:
        start = sparktrain.run_elastic(rounds_from_commit, args=(str(tmp_path), 60, commit_at), num_proc=N,
                                       min_num_proc=PER_HOST, max_num_proc=N, env=env, verbose=1,
                                       elastic_timeout=120, timeout=240)
        thread.join(5)
        assert start == commit_at
        survivors = read_ranks(str(tmp_path), f"-from{commit_at}")
        n = N - PER_HOST
        assert sorted(survivors) == list(range(n)), survivors
        by_host: dict[str, list[int]] = {}
        for r, info in sorted(survivors.items()):
            assert info["size"] == n and info["start"] == commit_at, info
            by_host.setdefault(info["hostname"], []).append(r)
        assert set(by_host) == set(hosts.names) - {hosts.names[dead]}, by_host
        assert sorted(by_host.values()) == [[2 * h, 2 * h + 1] for h in range(HOSTS - 1)], by_host
        lines = [r.getMessage() for r in caplog.records if "continuing with" in r.getMessage()]
        assert len(lines) == 1 and f"continuing with {n} rank(s)" in lines[0], lines
        runs = re.findall(r"launching \d+ rank\(s\) of rounds_from_commit, run (\w+)", caplog.text)
        assert len(runs) == 2, runs
        for run_id in runs:
            assert rank_processes(f"sparktrain-{run_id}-", timeout=30) == []
            for i in range(HOSTS - 1):
                assert [name for name in hosts.shm(i, standalone.workers[i].pid) if run_id in name] == []
        # Only the dead host's ranks' directories are left (its watchers died with it).
        left = work_dirs(runs[0]) + work_dirs(runs[1])
        assert all(int(re.search(r"-r(\d+)-", d).group(1)) // PER_HOST == dead for d in left), left
    finally:
        thread.join(60)
        standalone.start_worker(dead)
        wait_for_slots(session, N)


def fit_from_df(outdir):
    """A Keras fit from data=df through DistributedOptimizer; each rank records its weights' digest."""
    import socket

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd
    from helpers import record_rank, weights_digest

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    ds = sparktrain.data.dataset("features", label="label", batch_size=16, seed=3)
    history = model.fit(ds, epochs=3, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    shard = sparktrain.data.shard()
    record_rank(outdir, digest=weights_digest(model.get_weights()), hostname=socket.gethostname(),
                rows=int(shard.rows), loss=history.history["loss"])
    return history.history["loss"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_keras_fit_from_a_dataframe_on_16_ranks_ends_with_one_set_of_weights(cluster8, tmp_path):
    """run(data=df) of a Keras fit on 16 ranks across 8 hosts: every row is some rank's, every
    rank ends with the same weights, the loss falls, and no spool is left on any host."""
    from helpers import digits

    hosts, standalone, session = cluster8
    (x, y), _ = digits()
    df = session.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(len(y))],
                                 "features array<float>, label int")
    loss = sparktrain.run(fit_from_df, args=(str(tmp_path),), num_proc=N, data=df, timeout=540, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == list(range(N))
    assert {info["hostname"] for info in ranks.values()} == set(hosts.names)
    assert len({info["digest"] for info in ranks.values()}) == 1, {r: i["digest"][:8] for r, i in ranks.items()}
    assert sum(info["rows"] for info in ranks.values()) == len(y)
    assert loss[-1] < loss[0], loss
    nothing_left(hosts, standalone, ranks[0]["env"]["SPARKTRAIN_RUN_ID"])
