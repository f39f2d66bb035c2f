"""Encryption across simulated hosts: with Spark's encryption on and sparktrain's settings left at
their defaults, a Keras fit across hosts is encrypted, gives the clear run's weights bit for bit,
and puts nothing of what it carries on the wire (an AF_PACKET capture of a host's link)."""
from __future__ import annotations

import socket
import threading

import pytest

from multihost_cluster import HOSTS, MARKS

import sparktrain

pytestmark = MARKS

#: Bytes every rank broadcasts (through the ring between hosts) and prints (through the channel).
PATTERN = b"sparktrain-clear-marker-7f3a"


def fit_with_marker(pattern: bytes):
    """A small Keras fit through DistributedOptimizer; the pattern crosses the ring (a broadcast of
    its bytes, passed on unchanged) and the channel (a printed line). Rank 0 returns the weights."""
    import os

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
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [w.tolist() for w in model.get_weights()], os.environ["SPARKTRAIN_ENCRYPTION"], hvd.cross_size()


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
        weights, mode, hosts = sparktrain.run(fit_with_marker, args=(PATTERN,), num_proc=HOSTS, verbose=1, **kw)
    finally:
        wire = capture.stop()
    assert hosts == HOSTS
    return weights, mode, wire


@pytest.mark.timeout(400)
def test_sparks_encryption_encrypts_a_fit_across_hosts_with_the_clear_runs_weights(cluster, monkeypatch, caplog):
    sim, _, session = cluster
    jconf = session.sparkContext._conf._jconf
    # Spark's conf as a cluster with Spark's RPC encryption would have it (this tier's standalone
    # cluster does not run spark.authenticate, without which Spark itself ignores the key).
    jconf.set("spark.network.crypto.enabled", "true")
    try:
        sealed, mode, sealed_wire = _captured_run(sim)
        monkeypatch.setenv("SPARKTRAIN_ALLOW_UNENCRYPTED", "1")  # Spark's is on: clear must be allowed
        clear, clear_mode, clear_wire = _captured_run(sim, encryption="off")
    finally:
        jconf.remove("spark.network.crypto.enabled")
    assert (mode, clear_mode) == ("on", "off")
    launches = [r.getMessage() for r in caplog.records if "launching" in r.getMessage()]
    assert launches[0].endswith("; encrypted (AES-256-GCM between hosts and on the driver's channel)"), launches
    assert launches[1].endswith("; not encrypted"), launches
    assert sealed == clear  # the same reductions in the same order: the same bits
    # The clear run shows the pattern on the wire (ring and channel); the encrypted one nowhere.
    assert clear_wire.count(PATTERN) >= 64 and sealed_wire.count(PATTERN) == 0, (
        clear_wire.count(PATTERN), sealed_wire.count(PATTERN))
    assert len(sealed_wire) > 1 << 16  # it did capture the run's traffic
