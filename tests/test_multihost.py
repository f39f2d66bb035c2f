"""The multi-host tier: a Spark standalone cluster whose workers are simulated hosts
(tests/simhosts.py: a network namespace, hostname, /etc/hosts, /dev/shm and core each), started
once for the module. The driver is this process, on the hosts' bridge.

Skipped, with the reason, where simulated hosts cannot be made (not root, no ``ip``)."""
from __future__ import annotations

import glob
import logging
import os
import re
import tempfile
import time

import pytest

import simhosts
from conftest import make_spark, stop_spark
from helpers import fault_time, rank_processes, read_ranks, read_time

import sparktrain

WHY_NOT = simhosts.why_not()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

HOSTS, PER_HOST = 2, 2


@pytest.fixture(scope="module")
def cluster():
    from sparktrain.driver import cluster as capacity

    hosts = simhosts.SimHosts(HOSTS).up()
    standalone = session = None
    try:
        standalone = simhosts.Standalone(hosts, cores=PER_HOST).start()
        conf = standalone.session_conf()
        session = make_spark(standalone.url, **conf)
        found = capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)
        assert found.executors >= HOSTS, f"only {found.executors} executors registered; see {standalone.log_dir}"
        yield hosts, standalone, session
    finally:
        if session is not None:
            stop_spark(session)
        if standalone is not None:
            standalone.stop()
        left = hosts.down()
    assert not left, left


def probe(outdir):
    """What a rank sees of its host and of the others: placement, /dev/shm, the CPU budget, and
    the native engine's collectives across hosts."""
    import hashlib
    import socket

    import numpy as np

    from helpers import record_rank
    from sparktrain import engine

    comm = engine.from_env()
    r, n = comm.rank, comm.size
    marker = f"/dev/shm/sparktrain-test-{os.environ['SPARKTRAIN_RUN_ID']}-r{r}"
    open(marker, "w").close()
    comm.barrier()
    shm = sorted(name for name in os.listdir("/dev/shm") if name.startswith(os.path.basename(marker)[:-len(str(r))]))
    comm.barrier()
    os.unlink(marker)
    ints = ((np.arange(1_000_003, dtype=np.int64) * 7 + r * 3) % 11 - 5).astype(np.float32)  # exact sums
    total = comm.allreduce(ints, "sum")
    gathered = comm.allgather(np.full((r + 1, 2), r, np.int32))
    splits = [(r + j) % 3 + 1 for j in range(n)]
    received, received_splits = comm.alltoall(np.arange(sum(splits) * 2).reshape(-1, 2) + 1000 * r, splits)
    def ring_bytes(rows):
        before = comm.traffic()[1]
        comm.allgather(np.ones((rows,), np.float64))
        return comm.traffic()[1] - before

    gather_bytes = ring_bytes(100_000 + 1000 * r) - ring_bytes(0)  # less the shapes and the agreement
    facts = {"hostname": socket.gethostname(), "shm": shm, "node": comm.node, "engine_local_rank": comm.local_rank,
             "transport": comm.transport, "spin": comm.spin, "budget": os.environ.get("SPARKTRAIN_CPU_BUDGET"),
             "sum_digest": hashlib.sha256(total.tobytes()).hexdigest(),
             "sum_right": bool((total == sum(((np.arange(1_000_003) * 7 + k * 3) % 11 - 5) for k in range(n))).all()),
             "gathered": gathered.tolist(), "received": received.tolist(),
             "received_splits": [int(s) for s in received_splits], "gather_bytes": gather_bytes}
    comm.close()
    record_rank(outdir, **facts)
    return r


@pytest.mark.timeout(300)
def test_ranks_are_numbered_by_host_and_collectives_cross_hosts_exactly(cluster, tmp_path):
    hosts, standalone, _ = cluster
    n = HOSTS * PER_HOST
    assert sparktrain.run(probe, args=(str(tmp_path),), num_proc=n, verbose=0) == 0
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == list(range(n))
    by_host: dict[str, list[int]] = {}
    for r, info in sorted(ranks.items()):
        by_host.setdefault(info["hostname"], []).append(r)
    # Each simulated host runs PER_HOST ranks, numbered contiguously, host by host.
    assert set(by_host) <= set(hosts.names) and len(by_host) == HOSTS, by_host
    assert sorted(by_host.values()) == [list(range(h * PER_HOST, (h + 1) * PER_HOST)) for h in range(HOSTS)]
    for r, info in ranks.items():
        assert (info["local_rank"], info["local_size"]) == (r % PER_HOST, PER_HOST), info
        assert (info["cross_rank"], info["cross_size"]) == (r // PER_HOST, HOSTS), info
        assert (info["node"], info["engine_local_rank"]) == (info["cross_rank"], info["local_rank"]), info
        assert info["transport"] == "shm+tcp"
        # Each host's /dev/shm is its own: a rank sees its host's markers only.
        mine = by_host[info["hostname"]]
        assert [int(name.rsplit("-r", 1)[1]) for name in info["shm"]] == mine, info["shm"]
        # One core per host (a cpuset of one) for two ranks: the budget says so, and they sleep, not spin.
        assert (info["budget"], info["spin"]) == ("1", 0.0), info
        assert info["sum_right"] and info["sum_digest"] == ranks[0]["sum_digest"]
        assert info["gathered"] == [[k, k] for k in range(n) for _ in range(k + 1)]
        want_splits = [(k + r) % 3 + 1 for k in range(n)]
        assert info["received_splits"] == want_splits
        want = []
        for k in range(n):
            lo = sum((k + j) % 3 + 1 for j in range(r))
            want += [[2 * (lo + i) + 1000 * k, 2 * (lo + i) + 1 + 1000 * k] for i in range(want_splits[k])]
        assert info["received"] == want
        # Over the ring, a leader receives the other host's rows once; the others receive nothing.
        other = sum((100_000 + 1000 * k) * 8 for k in range(n) if ranks[k]["hostname"] != info["hostname"])
        assert info["gather_bytes"] == (other if info["local_rank"] == 0 else 0), info
    # Nothing of the run is left on any host: no rank process, nothing in the host's /dev/shm.
    run_id = ranks[0]["env"]["SPARKTRAIN_RUN_ID"]
    assert rank_processes(f"sparktrain-{run_id}-") == []
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if run_id in name] == []


def allreduce_until_stopped(outdir):
    """Every rank allreduces across the hosts until it is stopped; it says once that it runs, and where."""
    import json
    import socket

    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    if comm.rank == 0:
        with open(os.path.join(outdir, "run_id"), "w") as f:
            json.dump(os.environ["SPARKTRAIN_RUN_ID"], f)
    comm.allreduce(np.ones(1000), "sum")
    with open(os.path.join(outdir, f"host-{comm.rank}"), "w") as f:
        f.write(socket.gethostname())
    mark_time(outdir, f"running-{comm.rank}")
    while True:
        comm.allreduce(np.ones(1000), "sum")


def when_running(outdir, n: int, fault) -> tuple:
    """A started thread that runs ``fault()`` once every rank of ``n`` has written its running
    file in ``outdir``, and the list that gets the time it began."""
    import threading

    from helpers import wait_for_file

    at: list[float] = []

    def wait_then_fault():
        for r in range(n):
            wait_for_file(os.path.join(str(outdir), f"running-{r}"), 120)
        at.append(time.monotonic())
        fault()

    thread = threading.Thread(target=wait_then_fault, daemon=True)
    thread.start()
    return thread, at


def fail_by(tmp_path, n: int, fault) -> tuple:
    """Run ``allreduce_until_stopped`` on ``n`` ranks with ``fault()`` once they all run; returns
    the run's RankFailedError, when the fault began and when the run failed."""
    thread, at = when_running(tmp_path, n, fault)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(allreduce_until_stopped, args=(str(tmp_path),), num_proc=n, timeout=90, verbose=0)
    failed_at = time.monotonic()
    thread.join(5)
    return e.value, at[0], failed_at


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
        assert root.host == hosts.ips[1] and root.rank in _ranks_on(tmp_path, hosts.names[1]), root
        fault_time("silent partition", 15.0, failed_at - cut_at)
        # The cut-off host's ranks stop by themselves: nobody can reach them to tell them.
        assert rank_processes(f"sparktrain-{_run_id(tmp_path)}-", timeout=60) == []
    finally:
        hosts.heal(1)
    for i in range(HOSTS):
        assert [name for name in hosts.shm(i, standalone.workers[i].pid) if name.startswith("sparktrain-")] == []


def _ranks_on(outdir, hostname: str) -> list[int]:
    n = HOSTS * PER_HOST
    return [r for r in range(n) if open(os.path.join(outdir, f"host-{r}")).read() == hostname]


def _run_id(outdir) -> str:
    import json

    with open(os.path.join(outdir, "run_id")) as f:
        return json.load(f)


def allreduce_through(outdir, more):
    """Allreduces across the hosts, each checked, until ``more`` rounds after rank 0 has seen the
    file ``healed`` (the last element carries its word to everyone, so all stop alike); says when it
    is under way. Returns the rounds it made."""
    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    n, r = comm.size, comm.rank
    i = after = 0
    while True:
        x = np.full(250_001, r + i, np.float64)
        x[-1] = float(r == 0 and os.path.exists(os.path.join(outdir, "healed")))
        got = comm.allreduce(x, "sum")
        if not (got[:-1] == sum(k + i for k in range(n))).all():
            raise AssertionError(f"round {i}: wrong sum {got[:3]}")
        if i == 1:
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
        for i in range(HOSTS):
            hosts.shape(i, "100mbit")
        assert sparktrain.run(allreduce_through, args=(str(tmp_path), 10), num_proc=n, timeout=120, verbose=0) >= 10
    finally:
        for i in range(HOSTS):
            hosts.unshape(i)


@pytest.mark.timeout(300)
def test_a_host_that_dies_fails_the_run_naming_it(cluster, tmp_path):
    """Every process of one host is killed (its worker, executor, tasks and ranks) while the ranks
    allreduce across hosts. The run fails naming a rank of that host, and nothing of the run is left
    on the other host. The worker then starts again, for whatever runs next on the cluster."""
    from helpers import fault_time
    from sparktrain.driver import cluster as capacity

    hosts, standalone, session = cluster
    n = HOSTS * PER_HOST
    try:
        error, killed_at, failed_at = fail_by(tmp_path, n, lambda: hosts.kill_host(1))
        fault_time("host killed", 15.0, failed_at - killed_at)
        root = error.root_cause
        dead = _ranks_on(tmp_path, hosts.names[1])
        # The first to tell may be a rank of the dead host (its task lost) or a peer whose ring
        # connection to it closed: either way a rank of that host is named.
        assert (root.host == hosts.ips[1] and root.rank in dead) or \
            any(f"rank {r} died" in root.message for r in dead), error
        assert rank_processes(f"sparktrain-{_run_id(tmp_path)}-", timeout=30) == []
        assert [name for name in hosts.shm(0, standalone.workers[0].pid) if name.startswith("sparktrain-")] == []
        # The dead host's watchers died with it: its ranks' directories, collective key and all,
        # are still on its disk (the other host's tasks removed theirs).
        left = _work_dirs(_run_id(tmp_path))
        assert left and all(int(re.search(r"-r(\d+)-", d).group(1)) in dead for d in left), (left, dead)
    finally:
        standalone.start_worker(1)
        conf = dict(session.sparkContext.getConf().getAll())
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)
    # The next run's ranks sweep them away as they start.
    assert sparktrain.run(os.getpid, num_proc=n, verbose=0) > 0
    assert _work_dirs(_run_id(tmp_path)) == []


def _work_dirs(run_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"sparktrain-{run_id}-r*")))


def elastic_fit(outdir, epochs, fault_epoch, grow_to=None, batch_size=16, hold_for_resize=False):
    """A Keras fit from data=df that commits every epoch through hvd.elastic; marks running when every
    rank of the first attempt begins ``fault_epoch`` (0-based). With ``grow_to``, it trains until it
    has run 3 epochs at that size (or ``epochs``). Rank 0 returns what the test checks."""
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd
    from helpers import mark_time, record_rank, weights_digest

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(2e-3)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    sizes, resumed_at = [], []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size()), lambda: resumed_at.append(state.batch)])
    first_size = hvd.size()

    class Mark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if epoch == fault_epoch and hvd.size() == first_size and not sizes and not hold_for_resize:
                mark_time(outdir, f"running-{hvd.rank()}")

        def on_train_batch_end(self, batch, logs=None):
            # With hold_for_resize, the ranks of the first attempt say they run once batch 5 of
            # fault_epoch is done, and wait at batch 10 until rank 0 has seen the driver's resize
            # marker: it comes after batch 5 and before the epoch's end, whatever the timing.
            if hold_for_resize and self.epoch == fault_epoch and batch == 5 and not sizes:
                mark_time(outdir, f"running-{hvd.rank()}")
            if hold_for_resize and self.epoch == fault_epoch and batch == 10 and not sizes:
                import time

                from sparktrain.tensorflow import resize

                for _ in range(1800):  # every rank asks together (a broadcast), so all leave together
                    if resize.requested():
                        break
                    time.sleep(0.05)

        def on_epoch_end(self, epoch, logs=None):
            if hvd.size() == grow_to and epoch + 1 >= began[-1] + 3:
                self.model.stop_training = True  # the same on every rank: they share size and epoch

    began = []

    @hvd.elastic.run
    def train(state):
        began.append(state.epoch)  # after elastic.run restored the last commit
        ds = sparktrain.data.dataset("features", label="label", batch_size=batch_size, seed=3)
        state.model.fit(ds, epochs=epochs, initial_epoch=state.epoch, verbose=0, callbacks=[
            hvd.callbacks.MetricAverageCallback(), hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10_000), Mark()])
        return state.epoch

    train(state)
    shard = sparktrain.data.shard()
    record_rank(outdir, digest=weights_digest(state.model.get_weights()), size=hvd.size(), sizes=sizes,
                resumed_at=resumed_at,
                rows_per_rank=list(shard.rows_per_rank), steps=shard.steps_per_epoch(16), began=began)
    x, y = __import__("helpers").digits()[1]
    return float(state.model.evaluate(x, y, verbose=0)[1]) if hvd.rank() == 0 else None


@pytest.mark.timeout(420)
def test_an_elastic_fit_loses_a_host_and_finishes_on_the_other(cluster, tmp_path, caplog):
    """run_elastic of 4 ranks (min 2) from data=df: host 1 dies whole in epoch 3. The run goes on
    with the other host's 2 ranks from the epoch-2 commit, finishes every epoch with equal weights,
    as accurate as an uninterrupted run; nothing of it is left on the dead host once it is back."""
    import logging

    from helpers import digits, read_ranks
    from pyspark.ml.linalg import Vectors
    from sparktrain.driver import cluster as capacity

    hosts, standalone, session = cluster
    (x, y), _ = digits()
    df = session.createDataFrame([(Vectors.dense(x[i]), int(y[i])) for i in range(len(y))], ["features", "label"])
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "TF_CPP_MIN_LOG_LEVEL": "2",
           "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    epochs, n = 6, HOSTS * PER_HOST
    caplog.set_level(logging.INFO, logger="sparktrain")  # verbose=1 logs at INFO too
    outdir = tmp_path / "elastic"
    outdir.mkdir()
    thread, _ = when_running(outdir, n, lambda: hosts.kill_host(1))
    try:
        accuracy = sparktrain.run_elastic(elastic_fit, args=(str(outdir), epochs, 2), num_proc=n, min_num_proc=2,
                                          max_num_proc=n, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(outdir))
        survivors = [r for r in ranks if ranks[r]["size"] == 2]
        assert sorted(survivors) == [0, 1], ranks
        assert len({ranks[r]["digest"] for r in survivors}) == 1  # the 2 ranks end equal
        assert all(ranks[r]["began"] == [2] for r in survivors)  # resumed from the epoch-2 commit
        assert all(ranks[r]["sizes"] == [2] for r in survivors)  # the reset callbacks ran once, with the new size
        rows = ranks[0]["rows_per_rank"]
        assert sum(rows) == len(y) and max(rows) - min(rows) <= 1 and ranks[0]["steps"] * 16 >= max(rows)
        lines = [r.getMessage() for r in caplog.records if "continuing with 2 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and "from the last commit, at epoch 2" in lines[0], lines
    finally:
        standalone.start_worker(1)
        conf = dict(session.sparkContext.getConf().getAll())
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)
    # The dead host's directories went with the next run's start; an uninterrupted run for comparison.
    plain = tmp_path / "plain"
    plain.mkdir()
    baseline = sparktrain.run(elastic_fit, args=(str(plain), epochs, -1), num_proc=2, data=df, env=env, verbose=1)
    assert accuracy >= baseline - 0.02 and accuracy > 0.85, (accuracy, baseline)
    runs = re.findall(r"launching \d+ rank\(s\) of elastic_fit, run (\w+)", caplog.text)
    assert len(runs) == 3, runs  # the first attempt, the second, the baseline
    assert [d for r in runs for d in _work_dirs(r)] == []


@pytest.mark.timeout(420)
def test_an_elastic_fit_grows_back_when_the_host_returns(cluster, tmp_path, caplog):
    """run_elastic starts on 2 ranks while host 1 is down (max_num_proc=4); host 1's worker comes
    back during training. Once its slots have lasted SPARKTRAIN_ELASTIC_GROW_AFTER seconds, the
    ranks end the attempt at their next commit, and the run goes on with 4 ranks from it."""
    import logging

    from helpers import digits, read_ranks
    from pyspark.ml.linalg import Vectors
    from sparktrain.driver import cluster as capacity

    hosts, standalone, session = cluster
    conf = dict(session.sparkContext.getConf().getAll())
    hosts.kill_host(1)
    found = capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors <= 1, 60)
    assert found.executors == 1, found
    (x, y), _ = digits()
    df = session.createDataFrame([(Vectors.dense(x[i]), int(y[i])) for i in range(len(y))], ["features", "label"])
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "SPARKTRAIN_ELASTIC_GROW_AFTER": "3",
           "TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    caplog.set_level(logging.INFO, logger="sparktrain")
    thread, _ = when_running(tmp_path, PER_HOST, lambda: standalone.start_worker(1))
    try:
        sparktrain.run_elastic(elastic_fit, args=(str(tmp_path), 300, 1, HOSTS * PER_HOST), num_proc=PER_HOST,
                               min_num_proc=PER_HOST,
                               max_num_proc=HOSTS * PER_HOST, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(tmp_path))
        assert sorted(ranks) == [0, 1, 2, 3] and all(ranks[r]["size"] == 4 for r in ranks), ranks
        assert len({ranks[r]["digest"] for r in ranks}) == 1
        began = {ranks[r]["began"][0] for r in ranks}
        assert len(began) == 1 and 0 < began.pop() < 300, ranks  # resumed from the commit where it grew
        assert all(ranks[r]["sizes"] == [4] for r in ranks)
        lines = [r.getMessage() for r in caplog.records if "continuing with 4 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and "the cluster has slots for 4 rank(s)" in lines[0], lines
    finally:
        thread.join(120)
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= HOSTS, 120)


@pytest.mark.timeout(180)
def test_a_stall_across_hosts_is_reported_with_the_late_ranks_stack(cluster, tmp_path):
    """stall_warning=10: rank 3, on the second host, waits in user code before an allreduce the
    other three are in. The driver's report names rank 3 and its host, shows its stack down to
    the user's line, and the run goes on once the late rank is let go."""
    from test_stalls import _capture, _late_line, late_rank

    hosts, _, _ = cluster
    n = HOSTS * PER_HOST
    reports = _capture(str(tmp_path / "go"))
    try:
        total = sparktrain.run(late_rank, args=(str(tmp_path), n - 1), num_proc=n, timeout=150, verbose=0,
                               env={"SPARKTRAIN_STALL_WARNING": "10"})
    finally:
        logging.getLogger("sparktrain").removeHandler(reports)
    assert total == n * 24
    assert len(reports.reports) == 1, reports.reports
    report = reports.reports[0]
    head = re.search(rf"stall: ranks 0 \((\S+)\), 1 \(\S+\), 2 \(\S+\) have waited \d+ s in allreduce #2 "
                     rf"\(float32\[8,3\], sum\); rank {n - 1} has not arrived", report)
    late = re.search(rf"rank {n - 1} \((\S+)\) is after allreduce #1", report)
    assert head and late, report
    assert late.group(1) in hosts.ips and late.group(1) != head.group(1), report  # ranks are numbered by host
    assert f"line {_late_line()} in late_rank" in report, report
    seconds = reports.at[0] - read_time(str(tmp_path), "entered")
    fault_time("stall report across hosts, stall_warning=10 s", 20, seconds)
    print(f"stall report {seconds:.1f} s after the stall began")


@pytest.mark.timeout(300)
def test_a_decommissioned_worker_shrinks_an_elastic_fit_at_a_step(cluster, tmp_path, caplog):
    """spark.decommission.enabled: host 1's worker is told to leave (SIGPWR) in epoch 1 of a
    4-rank run_elastic fit. Spark stops counting its slots; the driver leaves the resize marker;
    the ranks commit at the end of the step in which rank 0 saw it and end the attempt without a
    failure; the run goes on with host 0's 2 ranks from that mid-epoch commit. (The worker is told
    after batch 5, and the ranks hold at batch 10 until the marker is down, so that it lands
    inside the epoch whatever the timing.)"""
    from helpers import digits, read_ranks
    from pyspark.ml.linalg import Vectors
    from sparktrain.driver import cluster as capacity

    hosts, standalone, session = cluster
    conf = dict(session.sparkContext.getConf().getAll())
    (x, y), _ = digits()
    df = session.createDataFrame([(Vectors.dense(x[i]), int(y[i])) for i in range(len(y))], ["features", "label"])
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic", "TF_CPP_MIN_LOG_LEVEL": "2",
           "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
    caplog.set_level(logging.INFO, logger="sparktrain")
    n = HOSTS * PER_HOST
    told: list[float] = []
    thread, _ = when_running(tmp_path, n, lambda: (told.append(time.time()), standalone.decommission(1)))
    try:
        sparktrain.run_elastic(elastic_fit, args=(str(tmp_path), 3, 1, None, 2, True), num_proc=n, min_num_proc=PER_HOST,
                               max_num_proc=n, data=df, env=env, verbose=1, elastic_timeout=120)
        thread.join(5)
        ranks = read_ranks(str(tmp_path))
        assert sorted(ranks) == [0, 1] and all(ranks[r]["size"] == PER_HOST for r in ranks), ranks
        assert len({ranks[r]["digest"] for r in ranks}) == 1
        assert all(ranks[r]["sizes"] == [PER_HOST] for r in ranks)  # one reset, with the new size
        resumed = {(ranks[r]["began"][0], ranks[r]["resumed_at"][0]) for r in ranks}
        assert len(resumed) == 1, ranks
        epoch, batch = resumed.pop()
        assert epoch == 1 and batch > 5, ranks  # committed at a step after the notice, inside the epoch
        lines = [r.getMessage() for r in caplog.records if "continuing with 2 rank(s)" in r.getMessage()]
        assert len(lines) == 1 and f"host {hosts.ips[1]} is being decommissioned" in lines[0], lines
        assert f"from the last commit, at epoch {epoch}, batch {batch};" in lines[0], lines
        marker = glob.glob(str(tmp_path / "elastic" / "*" / "resize-1"))
        seconds = os.path.getmtime(marker[0]) - told[0]
        fault_time("decommission notice (SIGPWR) to the resize marker", 10, seconds)
        print(f"resize marker {seconds:.1f} s after the worker was told to leave")
        assert not [r for r in caplog.records if "was lost" in r.getMessage()]  # no rank failed
    finally:
        thread.join(60)
        standalone.start_worker(1)
        capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.slots(False) >= n, 120)
