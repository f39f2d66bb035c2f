"""Keras 3 on JAX across simulated hosts (the multi-host tier's cluster, tests/multihost_cluster.py):
``run(..., backend="jax", data=df)`` on 2 hosts x 2 ranks, each rank in its own network namespace
with its own hostname, so JAX's coordinator and its gloo collectives cross the hosts' bridge."""
from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import digits_mlp, digits_mlp_accuracy, read_ranks, record_rank, skip_without_jax
from multihost_cluster import HOSTS, MARKS, PER_HOST

import sparktrain

skip_without_jax()
pytestmark = [*MARKS, pytest.mark.jax]

BATCH, EPOCHS = 24, 10


def fit_across_hosts(outdir: str, x_test, y_test, x_all, y_all):
    """A DataParallel fit of each rank's share of the DataFrame; rank 0 also trains the same
    model on the same global batch in this one process."""
    import hashlib
    import socket

    import jax
    import keras

    import sparktrain.data
    import sparktrain.keras as hvd

    keras.utils.set_random_seed(1)
    hvd.init()
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    ds = sparktrain.data.pydataset("features", label="label", batch_size=BATCH, seed=3)
    model = digits_mlp()
    model.fit(ds, epochs=EPOCHS, verbose=0)
    weights = [np.asarray(w) for w in model.get_weights()]
    got = {"hostname": socket.gethostname(), "len": len(ds),
           "process": [jax.process_index(), jax.process_count(), jax.device_count()],
           "coordinator": os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"],
           "digest": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
           "accuracy": digits_mlp_accuracy(weights, x_test, y_test)}
    if hvd.rank() == 0:
        keras.distribution.set_distribution(None)
        keras.utils.set_random_seed(1)
        alone = digits_mlp()
        alone.fit(x_all, y_all, batch_size=BATCH * hvd.size(), epochs=EPOCHS, verbose=0)
        got["alone"] = digits_mlp_accuracy([np.asarray(w) for w in alone.get_weights()], x_test, y_test)
    record_rank(outdir, got=got)
    return got["digest"]


@pytest.mark.timeout(300)
def test_a_data_parallel_jax_fit_across_hosts_ends_with_one_set_of_weights_as_accurate_as_one_process(
        cluster, tmp_path):
    from sklearn.datasets import load_digits

    hosts, _, session = cluster
    n = HOSTS * PER_HOST
    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1500], order[1500:]
    df = session.createDataFrame([(x[i].tolist(), int(y[i])) for i in train], "features array<float>, label int")
    digest = sparktrain.run(fit_across_hosts, args=(str(tmp_path), x[test], y[test], x[train], y[train]),
                            num_proc=n, backend="jax", data=df, timeout=240, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == list(range(n))
    by_host: dict[str, list[int]] = {}
    for r, info in sorted(ranks.items()):
        got = info["got"]
        assert got["process"] == [r, n, n], got  # one JAX process per rank, one CPU device each
        by_host.setdefault(got["hostname"], []).append(r)
    # The process group spans the hosts: PER_HOST ranks on each, numbered host by host.
    assert sorted(by_host.values()) == [list(range(h * PER_HOST, (h + 1) * PER_HOST)) for h in range(HOSTS)]
    assert set(by_host) <= set(hosts.names), by_host
    # The coordinator is rank 0's host, not this driver's.
    coordinator_host = ranks[0]["got"]["coordinator"].rsplit(":", 1)[0]
    assert {info["got"]["coordinator"] for info in ranks.values()} == {ranks[0]["got"]["coordinator"]}
    assert coordinator_host != "127.0.0.1"
    assert len({info["got"]["digest"] for info in ranks.values()}) == 1 and digest == ranks[0]["got"]["digest"]
    assert len({info["got"]["len"] for info in ranks.values()}) == 1  # the same steps on every rank
    got = ranks[0]["got"]
    print(f"accuracy: {n} ranks on {HOSTS} hosts {got['accuracy']:.4f}, one process {got['alone']:.4f}")
    assert got["accuracy"] > 0.9 and abs(got["accuracy"] - got["alone"]) <= 0.02


@pytest.mark.timeout(300)
def test_the_fused_engine_path_across_hosts_ends_with_the_weights_of_data_parallel(cluster, tmp_path):
    """``sparktrain.keras.DistributedOptimizer`` on JAX across 2 hosts x 2 ranks: each step's fused gradients
    cross the hosts through the native engine (its XLA FFI handler), and the fit ends with the weights of
    the same fit under ``DataParallel`` (XLA's collectives), every rank the same (tests/test_jax_engine.py
    runs it on one host)."""
    from sklearn.datasets import load_digits
    from test_jax_engine import BATCH as ROWS, STEPS, fit_both_ways

    n = HOSTS * PER_HOST
    x, y = load_digits(return_X_y=True)
    rows = ROWS * n * STEPS
    x, y = (x[:rows] / 16).astype(np.float32), y[:rows].astype(np.int32)
    sparktrain.run(fit_both_ways, args=(str(tmp_path), x, y, 1), num_proc=n, backend="jax", timeout=240, verbose=0)
    results = [info["got"] for _, info in sorted(read_ranks(str(tmp_path)).items())]
    assert len(results) == n
    assert len({r["digest"] for r in results}) == 1 and len({r["loss"] for r in results}) == 1
    for r in results:
        assert r["ffi"] is True and r["moved"] > 1e-2
        assert r["max_difference"] < 1e-5, r
