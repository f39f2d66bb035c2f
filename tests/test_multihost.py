"""The multi-host tier: placement, the CPU budget and collectives across simulated hosts, the
network ranks use, and encryption on the wire (the cluster, started once for the tier:
tests/multihost_cluster.py)."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from helpers import rank_processes, read_ranks
from multihost_cluster import HOSTS, MARKS, PER_HOST

import sparktrain

pytestmark = MARKS


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
    # From 4 MiB the host's phases and the ring run in segments at once (native/pipeline.c).
    from native_ranks import pipelined

    large = pipelined(comm, (("float32", "sum"), ("float16", "max"), ("int32", "average")), ("float32",))
    facts = {"hostname": socket.gethostname(), "shm": shm, "node": comm.node, "engine_local_rank": comm.local_rank,
             "transport": comm.transport, "spin": comm.spin, "budget": os.environ.get("SPARKTRAIN_CPU_BUDGET"),
             "sum_digest": hashlib.sha256(total.tobytes()).hexdigest(),
             "sum_right": bool((total == sum(((np.arange(1_000_003) * 7 + k * 3) % 11 - 5) for k in range(n))).all()),
             "gathered": gathered.tolist(), "received": received.tolist(),
             "received_splits": [int(s) for s in received_splits], "gather_bytes": gather_bytes,
             "large_bad": large["bad"], "large_digests": large["digests"]}
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
        # The pipelined allreduce: numpy's results, and the ring's order bit for bit, the same on every rank.
        assert info["large_bad"] == [] and info["large_digests"] == ranks[0]["large_digests"], info["large_bad"]
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


def nics_probe(outdir):
    """A 16 MiB allreduce across the hosts, then the addresses this host's TCP connections reach."""
    import socket

    import numpy as np

    from helpers import record_rank
    from sparktrain import engine

    comm = engine.from_env()
    total = comm.allreduce(np.full(4 << 20, comm.rank + 1, np.float32), "sum")
    peers = set()
    with open("/proc/net/tcp") as f:  # this host's network namespace: its executor's, tasks' and ranks' sockets
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # established
                peers.add(socket.inet_ntoa(bytes.fromhex(fields[2].split(":")[0])[::-1]))
    comm.barrier()
    comm.close()
    record_rank(outdir, right=bool((total == sum(range(1, comm.size + 1))).all()), peers=sorted(peers),
                hostname=socket.gethostname())
    return comm.rank


@pytest.mark.timeout(300)
def test_process_sets_join_rings_across_hosts(cluster, tmp_path):
    """Horovod's process sets on 3 ranks, 2 on one host and 1 on the other: the sets {0, 2} and
    {1, 2} join a TCP ring between hosts, {1} is alone, every rank's set mixes shared memory and
    TCP; every collective on each, against numpy (test_process_sets.py's ranks and checks), and
    every set's listener closed after."""
    from test_process_sets import check_sets, run_sets

    got = run_sets(tmp_path, {}, num_proc=3)
    assert check_sets(got, tcp=True) == []


@pytest.mark.timeout(180)
def test_nics_puts_the_channel_and_the_ring_on_the_network_it_names(cluster, tmp_path):
    """Each host has a second network (eth1, its own bridge and subnet). With nics naming that
    subnet, the ranks reach the driver's channel and each other there, while Spark keeps to the
    first network: the ring's bytes cross the second network's links, not the first's."""
    hosts, _, _ = cluster
    n = HOSTS * PER_HOST
    sent = lambda network: [hosts.bytes_sent(i, network) for i in range(HOSTS)]  # noqa: E731
    data0, main0 = sent("data"), sent("main")
    assert sparktrain.run(nics_probe, args=(str(tmp_path),), num_proc=n, verbose=0,
                          nics=f"{hosts.data_subnet}.0/24") == 0
    data1, main1 = sent("data"), sent("main")
    ranks = read_ranks(str(tmp_path))
    host_of = {r: hosts.names.index(info["hostname"]) for r, info in ranks.items()}
    for r, info in ranks.items():
        assert info["right"], info
        assert info["env"]["MASTER_ADDR"] == hosts.data_ips[host_of[0]], info["env"]
        # The task's channel goes to the driver's address on the second network; the ring to the other host's.
        assert hosts.data_driver_ip in info["peers"], info["peers"]
        assert hosts.data_ips[1 - host_of[r]] in info["peers"], info["peers"]
    # A ring allreduce over 2 hosts sends the whole 16 MiB from each host once; Spark's own traffic
    # (the task, its result, heartbeats) is far less.
    for i in range(HOSTS):
        assert data1[i] - data0[i] >= 16 << 20, (i, data1[i] - data0[i])
        assert main1[i] - main0[i] < 4 << 20, (i, main1[i] - main0[i])


def test_a_host_without_the_named_network_fails_its_ranks_naming_it(cluster):
    """nics names an address only the driver has: it starts, and each rank's task says that its host
    has no such network, with the host's interfaces and the fix."""
    hosts, _, _ = cluster
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(os.getpid, num_proc=HOSTS * PER_HOST, verbose=0, nics=f"{hosts.data_driver_ip}/32")
    root = e.value.root_cause
    assert f"nics={hosts.data_driver_ip}/32 names no interface or address of rank {root.rank}'s host" in root.message
    assert f"rank {root.rank}'s host {root.host}" in root.message and root.host in hosts.ips, root
    assert any(f"eth1 {ip}" in root.message for ip in hosts.data_ips) and "SPARKTRAIN_NICS" in root.message


def test_check_reports_what_each_host_offers_its_ranks(cluster, monkeypatch):
    """`sparktrain check` against the standalone master: each host's executor, its one CPU (its
    cpuset), its two networks, and the address nics picks there."""
    import io
    import re

    from sparktrain.cli.check import run_check

    hosts, _, session = cluster
    monkeypatch.setenv("SPARKTRAIN_NICS", f"{hosts.data_subnet}.0/24")
    out = io.StringIO()
    code = run_check(lambda: (session, False), out=out)
    text = out.getvalue()
    assert code == 0, text
    assert re.search(r"^  executors +2 registered$", text, re.M), text
    assert f"Hosts (CPUs a task can use: affinity and cgroup quota; networks; nics={hosts.data_subnet}.0/24)" in text
    for i in range(HOSTS):
        label = f"{hosts.ips[i]} (2 task(s))"
        want = f"  {label:<18} 1 CPU(s); eth0 {hosts.ips[i]}, eth1 {hosts.data_ips[i]}; nics -> {hosts.data_ips[i]}"
        assert want in text.splitlines(), text
    assert "[FAIL]" not in text


def returns_bytes(n):
    import sparktrain

    return bytes(range(256)) * n if sparktrain.rank() == 0 else None


@pytest.mark.timeout(120)
def test_rank_0_sends_its_checkpoint_to_azurite_on_the_drivers_host(cluster):
    """checkpoint_url=abfs://: rank 0, on a simulated host, writes straight to an Azurite on the
    driver's host, through the bridge; the driver gets the URL and reads back the same bytes."""
    from storage_servers import Azurite, require_azurite

    from sparktrain import storage

    require_azurite()
    hosts, _, _ = cluster
    server = Azurite(host=hosts.driver_ip)
    server.start()
    try:
        options = server.options()
        storage.filesystem("abfs://x", options)[0].mkdir("models")
        url = "abfs://models/run/model.bin"
        got = sparktrain.run(returns_bytes, args=(12_000,), num_proc=HOSTS * PER_HOST, checkpoint_url=url,
                             storage_options=options, verbose=0)
        assert got == url
        assert storage.get_bytes(url, options) == bytes(range(256)) * 12_000
        assert storage.read_manifest(url, options)["size"] == 256 * 12_000
    finally:
        server.stop()
        import shutil

        shutil.rmtree(server.workspace, ignore_errors=True)


def spool_probe(outdir):
    """Where this rank's share of the fed DataFrame was spooled, and how many rows it holds."""
    import socket

    import sparktrain.data
    from helpers import record_rank

    shard = sparktrain.data.shard()
    record_rank(outdir, data_dir=os.environ["SPARKTRAIN_DATA_DIR"], hostname=socket.gethostname(),
                rows=int(shard.rows), rows_per_rank=[int(n) for n in shard.rows_per_rank])
    return 0


@pytest.mark.timeout(120)
def test_fed_rows_spool_on_each_hosts_local_dirs_and_go_with_the_run(cluster, tmp_path):
    """run(data=df) across hosts: each rank's share is spooled under its own host's Spark local
    directory (the worker's SPARK_LOCAL_DIRS), every row is someone's, and no spool is left."""
    import glob

    hosts, _, session = cluster
    assert sparktrain.run(spool_probe, args=(str(tmp_path),), num_proc=HOSTS * PER_HOST, data=session.range(0, 1001),
                          verbose=0) == 0
    ranks = read_ranks(str(tmp_path))
    for info in ranks.values():
        home = hosts.home(hosts.names.index(info["hostname"]))
        assert info["data_dir"].startswith(os.path.join(home, "local") + os.sep), (info["data_dir"], home)
    assert sum(info["rows"] for info in ranks.values()) == 1001
    assert ranks[0]["rows_per_rank"] == [ranks[r]["rows"] for r in sorted(ranks)]
    run_id = ranks[0]["env"]["SPARKTRAIN_RUN_ID"]
    for i in range(HOSTS):
        assert glob.glob(os.path.join(hosts.home(i), "local", "**", f"sparktrain-{run_id}-*"), recursive=True) == []


# -- encryption across hosts: with Spark's encryption on and sparktrain's settings at their defaults, a
# Keras fit across hosts is encrypted, gives the clear run's weights bit for bit, and puts nothing of
# what it carries on the wire (an AF_PACKET capture of a host's link) ------------------------------

#: Bytes every rank broadcasts (through the ring between hosts) and prints (through the channel).
PATTERN = b"sparktrain-clear-marker-7f3a"


def fit_with_marker(pattern: bytes):
    """A small Keras fit through DistributedOptimizer; the pattern crosses the ring (a broadcast of
    its bytes, passed on unchanged) and the channel (a printed line). Rank 0 returns the weights."""
    import json
    import os
    import shutil
    import tempfile

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import sparktrain.keras as hvd

    hvd.init()
    sent = hvd.broadcast(np.frombuffer(pattern * 64, np.uint8), root_rank=0)
    assert bytes(np.asarray(sent)) == pattern * 64
    print(pattern.decode() * 4)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((64, 16)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss="sparse_categorical_crossentropy")
    trace = os.path.join(tempfile.mkdtemp(prefix="sparktrain-test-trace-"), "trace.json")
    hvd.start_timeline(trace)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    with open(hvd.stop_timeline()) as f:
        buckets = {e["name"] for e in json.load(f)["traceEvents"] if e.get("tid") == 1 and e.get("ph") == "X"}
    shutil.rmtree(os.path.dirname(trace))
    return [w.tolist() for w in model.get_weights()], os.environ["SPARKTRAIN_ENCRYPTION"], hvd.cross_size(), \
        len(buckets)


class Capture:
    """Every frame on one interface (AF_PACKET, as root), kept until stopped."""

    def __init__(self, interface: str):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)  # how often the reader looks whether it is stopped
        self.frames: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except socket.timeout:
                continue

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()
        return b"".join(self.frames)


def _captured_run(sim, **kw):
    capture = Capture(sim.veths[0])  # host 0's link: its ranks' ring connections and channels
    try:
        # One rank per host (Spark offers each executor a task in turn): the ring, at the least cost.
        weights, mode, hosts, buckets = sparktrain.run(fit_with_marker, args=(PATTERN,), num_proc=HOSTS, verbose=1,
                                                       **kw)
    finally:
        wire = capture.stop()
    assert hosts == HOSTS
    return weights, mode, wire, buckets


@pytest.mark.timeout(400)
def test_sparks_encryption_encrypts_a_bucketed_fit_across_hosts_with_the_clear_fused_runs_weights(cluster, monkeypatch,
                                                                                                   caplog):
    sim, _, session = cluster
    jconf = session.sparkContext._conf._jconf
    # Spark's conf as a cluster with Spark's RPC encryption would have it (this tier's standalone
    # cluster does not run spark.authenticate, without which Spark itself ignores the key).
    jconf.set("spark.network.crypto.enabled", "true")
    try:
        # Encrypted in gradient buckets of 64 bytes; clear in one fused reduction.
        sealed, mode, sealed_wire, buckets = _captured_run(sim, env={"SPARKTRAIN_BUCKET_BYTES": "64"})
        monkeypatch.setenv("SPARKTRAIN_ALLOW_UNENCRYPTED", "1")  # Spark's is on: clear must be allowed
        clear, clear_mode, clear_wire, fused = _captured_run(sim, encryption="off",
                                                             env={"SPARKTRAIN_BUCKET_BYTES": "0"})
    finally:
        jconf.remove("spark.network.crypto.enabled")
    assert (mode, clear_mode) == ("on", "off")
    launches = [r.getMessage() for r in caplog.records if "launching" in r.getMessage()]
    assert launches[0].endswith("; encrypted (AES-256-GCM between hosts and on the driver's channel)"), launches
    assert launches[1].endswith("; not encrypted"), launches
    assert (buckets, fused) == (3, 0)  # the second layer's kernel and bias, the first's bias, its kernel; none fused
    assert sealed == clear  # the same sums, in buckets or fused, encrypted or not: the same bits
    # The clear run shows the pattern on the wire (ring and channel); the encrypted one nowhere.
    assert clear_wire.count(PATTERN) >= 64 and sealed_wire.count(PATTERN) == 0, (
        clear_wire.count(PATTERN), sealed_wire.count(PATTERN))
    assert len(sealed_wire) > 1 << 16  # it did capture the run's traffic


def test_hosts_left_up_by_a_killed_test_process_are_taken_down_by_the_next_set(tmp_path):
    """A test process SIGKILLed before its teardown leaves its hosts up, a process in one of them
    included; the next set's up() takes them down by their recorded names (namespaces, links,
    cgroups, that process, the record) and leaves a set whose owner still runs alone."""
    import subprocess
    import sys

    import simhosts

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, time; sys.path.insert(0, {here!r}); import simhosts; h = simhosts.SimHosts(2).up(); "
            "p = h.popen(0, ['sleep', '600']); print(h.tag, p.pid, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        tag, sleeper = owner.stdout.readline().split()
        assert os.path.exists(os.path.join(simhosts.RECORDS, f"{tag}.json"))
        sleeper_started = simhosts._started(int(sleeper))
        assert sleeper in open(f"{simhosts.CPUSET}/sparktrain-sim-{tag}-h0/cgroup.procs").read().split()
    finally:
        owner.kill()  # our own child, not yet reaped
        owner.wait(10)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"st{tag}h0" in netns and f"st{tag}h1" in netns, netns  # left up
    live = simhosts.SimHosts(1).up()  # this process owns it: the next sweep leaves it
    try:
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"st{tag}" not in netns and f"st{tag}" not in links and f"stb{tag}" not in links, (netns, links)
        assert not os.path.exists(f"{simhosts.CPUSET}/sparktrain-sim-{tag}-h0")
        # Gone: its pid unused, another process's, or a zombie that init has not yet reaped.
        assert simhosts._started(int(sleeper)) != sleeper_started or simhosts.process_state(int(sleeper)) == "Z"
        assert not os.path.exists(os.path.join(simhosts.RECORDS, f"{tag}.json"))
        assert simhosts.sweep_leftovers() == [] and os.path.exists(os.path.join(simhosts.RECORDS, f"{live.tag}.json"))
        assert f"st{live.tag}h0" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        assert live.down() == []
