"""The native engine under sparktrain.run on a real local[3] Spark: the Horovod-API collectives
eager and inside tf.function, and Keras 3 model.fit with the DistributedOptimizer."""
from __future__ import annotations

import json

import pytest

import sparktrain
from conftest import module_spark
from helpers import assert_collectives, read_ranks, record_rank
from sparktrain import engine

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]

from test_keras import ENV, collectives, fit_digits  # noqa: E402 - the same training as TensorFlow's ring

spark = module_spark("local[3]")


def collectives_and_engine(outdir):
    import sparktrain.tensorflow as hvd

    collectives(outdir)
    record_rank(outdir, tag="-engine", engine=hvd.collective_engine())


def engine_of_fit(outdir, *args):
    import sparktrain.tensorflow as hvd

    accuracy = fit_digits(outdir, *args)
    record_rank(outdir, tag="-engine", engine=hvd.collective_engine())
    return accuracy


FIT_ARGS = (10, 32, 0.001, True)


def collectives_then_fit(outdir):
    """One run of 3 ranks for three tests: the collectives, then model.fit on the native engine (the
    default), after which rank 0 trains the same model alone as the reference."""
    import os

    collectives_and_engine(os.path.join(outdir, "collectives"))
    return engine_of_fit(os.path.join(outdir, "native"), *FIT_ARGS, True)


@pytest.fixture(scope="module")
def native_run(spark, tmp_path_factory):
    outdir = tmp_path_factory.mktemp("native_run")
    (outdir / "collectives").mkdir()
    (outdir / "native").mkdir()
    accuracy = sparktrain.run(collectives_then_fit, args=(str(outdir),), num_proc=3, env=ENV, verbose=0)
    return outdir, accuracy


def test_collectives_run_on_the_native_engine(native_run):
    outdir, _ = native_run
    engines = read_ranks(str(outdir / "collectives"), tag="-engine")
    assert {r: e["engine"] for r, e in engines.items()} == {0: "native", 1: "native", 2: "native"}
    ranks = read_ranks(str(outdir / "collectives"))
    assert_collectives(ranks)


def test_keras_fit_on_3_ranks_matches_one_process(native_run):
    outdir, three = native_run
    ranks = read_ranks(str(outdir / "native"))
    assert sorted(ranks) == [0, 1, 2]
    # One process with the same global batch (3 x 32) and the same learning rate (0.001 x 3):
    # rank 0 trains it alone after the distributed fit.
    one = ranks[0]["one"]
    # Different initial weights (seeded by rank), made equal by the broadcast callback...
    assert len({info["initial"] for info in ranks.values()}) == 3
    # ...and kept equal, bit for bit, by averaging every step's gradients.
    assert len({info["final"] for info in ranks.values()}) == 1
    assert {info["optimizer"] for info in ranks.values()} == {"Adam"}
    # MetricAverageCallback: every rank ends each epoch with the same (averaged) metrics.
    histories = [json.dumps(info["history"], sort_keys=True) for info in ranks.values()]
    assert len(set(histories)) == 1
    assert three > 0.85 and abs(three - one) <= 0.02, (three, one)


def fit(tmp_path, sub, env):
    (tmp_path / sub).mkdir()
    accuracy = sparktrain.run(engine_of_fit, args=(str(tmp_path / sub), *FIT_ARGS), num_proc=3,
                              env={**ENV, **env}, verbose=0)
    return accuracy, fitted(tmp_path / sub)


def fitted(outdir):
    """Which engines the ranks' fit ran on, after checking that every rank ended with the same weights."""
    ranks = read_ranks(str(outdir))
    engines = {e["engine"] for e in read_ranks(str(outdir), tag="-engine").values()}
    assert sorted(ranks) == [0, 1, 2]
    assert len({info["final"] for info in ranks.values()}) == 1  # bit-identical weights on every rank
    return engines


def test_keras_fit_on_the_native_engine_is_bit_identical_and_as_accurate_as_tensorflows_ring(native_run, tmp_path):
    outdir, native_accuracy = native_run
    assert fitted(outdir / "native") == {"native"}
    ring_accuracy, engines = fit(tmp_path, "ring", {"SPARKTRAIN_CPU_COLLECTIVES": "tensorflow"})
    assert engines == {"tensorflow"}
    assert native_accuracy > 0.85 and native_accuracy >= ring_accuracy - 0.02, (native_accuracy, ring_accuracy)


def test_keras_fit_over_the_forced_tcp_ring(spark, tmp_path):
    accuracy, engines = fit(tmp_path, "tcp", {"SPARKTRAIN_CPU_TRANSPORT": "tcp"})
    assert engines == {"native"} and accuracy > 0.85
