"""Collectives in TensorFlow 1 graphs run by a session, through sparktrain's TensorFlow kernels:
each kernel hands its collective to the kernels' sequencer (native/tf_sequencer.cc) and frees
the session's thread, so a step with more independent collectives than the session has
threads runs; the engine's failures are TensorFlow's own classes, as eagerly; ranks that wait
for collectives no other rank runs fail together, naming what each waits for. Real Spark, real
ranks, numpy as the reference. (tests/test_hvd_collectives.py's tf1_graph checks the rest of the
graph path, on the kernels and through numpy_function, and runs these ranks after its own on
the kernels: ``graph_ranks`` there, ``check_graph_ranks`` here.)"""
from __future__ import annotations

import re

import numpy as np

from helpers import record_rank

#: Whose records these are, beside the rank's others in the same directory.
TAG = "-tf1-kernels"
#: The sequencer's timeout while ranks wait for collectives no other rank runs.
STUCK_SECONDS = 3.0


def _error(run) -> str:
    """The class of the error ``run()`` raised (TensorFlow's or sparktrain's), or "no error"."""
    try:
        run()
        return "no error"
    except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
        return type(e).__name__


def graph_ranks(outdir):
    """Run on every rank (after ``init()`` or not); records ``got`` under :data:`TAG`."""
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.tensorflow import kernels

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    got: dict = {"kernels": hvd.collective_kernels()}
    # One inter-op thread of the session's own: each collective used to hold it until every rank ran it.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        step = [hvd.allreduce(tf.fill([3], float(r)), op=hvd.Sum),
                hvd.allreduce(tf.fill([2, 2], r + 1), op=hvd.Max),
                hvd.allreduce(tf.fill([3], float(2 * r)), op=hvd.Sum),  # the shape and dtype of the first
                hvd.allgather(tf.fill([r + 1, 2], float(r))),
                hvd.allgather(tf.fill([1], r)),
                hvd.reducescatter(tf.fill([2 * n + 1, 2], float(r + 1)), op=hvd.Sum),
                hvd.broadcast(tf.fill([4], float(r)), root_rank=n - 1),
                hvd.alltoall(tf.reshape(tf.range(2 * n, dtype=tf.float32) + 100.0 * r, [2 * n, 1])),
                *hvd.grouped_allreduce([tf.fill([2], float(r)), tf.fill([3], r), tf.fill([1], float(r))],
                                       op=hvd.Sum),
                hvd.allreduce(tf.fill([5], float(2 * r)), op=hvd.Average)]
        got["many"] = [sess.run(step)[i].tolist() for i in range(len(step))]
        got["many_again"] = [a.tolist() for a in sess.run(step)]  # the same keys run again

        def after():
            return sess.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum)).tolist()

        # Disagreeing ranks: FailedPreconditionError as eagerly, and the next collective runs.
        got["mismatch/plain"] = _error(lambda: sess.run(hvd.allreduce(tf.ones([2 + r]))))
        got["after/plain"] = after()
        fused = [hvd.allreduce(tf.ones([2]), op=hvd.Sum), hvd.allreduce(tf.ones([2 + r])),
                 hvd.allgather(tf.ones([1, 1 + r])), hvd.broadcast(tf.ones([3]), root_rank=0)]
        got["mismatch/fused"] = _error(lambda: sess.run(fused))
        got["after/fused"] = after()
        grouped = hvd.grouped_allreduce([tf.ones([2]), tf.ones([1 + r]), tf.ones([2], tf.int32)])
        got["mismatch/grouped"] = _error(lambda: sess.run(grouped))
        got["after/grouped"] = after()
        dtype = tf.float32 if r == 0 else tf.float64
        got["mismatch/dtype"] = _error(lambda: sess.run(hvd.allreduce(tf.ones([2], dtype))))
        got["after/dtype"] = after()
        got["mismatch/root"] = _error(lambda: sess.run(hvd.broadcast(tf.ones([2]), root_rank=r)))
        got["after/root"] = after()
        got["bad/root"] = _error(lambda: sess.run(hvd.broadcast(tf.ones([2]), root_rank=n)))
        try:
            hvd.allreduce(tf.ones([2]), op=hvd.Adasum)
            got["adasum"] = "no error"
        except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
            got["adasum"] = f"{type(e).__name__}: {e}"
    # Ranks waiting for collectives no other rank runs: rank 0 builds one more, so its op has
    # another key; every rank fails after the (shortened) timeout, naming each rank's wait. The
    # keys of this graph disagree from there on; the next graph's agree again.
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        if r == 0:
            hvd.allreduce(tf.ones([2]))
        lonely = hvd.allreduce(tf.ones([2]), op=hvd.Sum)
        kernels.set_timeout(STUCK_SECONDS)
        try:
            sess.run(lonely)
            got["stuck"] = "no error"
        except tf.errors.OpError as e:
            got["stuck"] = f"{type(e).__name__}: {e.message}"
        kernels.set_timeout(60.0)
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        got["after/stuck"] = sess.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum)).tolist()
    # The same collectives eagerly, for the classes they raise there.
    got["eager/mismatch/plain"] = _error(lambda: hvd.allreduce(tf.ones([2 + r])))
    got["eager/mismatch/dtype"] = _error(lambda: hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64)))
    got["eager/mismatch/root"] = _error(lambda: hvd.broadcast(tf.ones([2]), root_rank=r))
    got["eager/bad/root"] = _error(lambda: hvd.broadcast(tf.ones([2]), root_rank=n))
    got["eager/after"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist()
    # shutdown() ends the sequencer's thread; a graph after init() again starts it again.
    got["thread/running"] = _sequencer_running()
    hvd.shutdown()
    got["thread/after_shutdown"] = _sequencer_running()
    hvd.init()
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        got["after/reinit"] = sess.run(hvd.allreduce(tf.fill([2], float(r)), op=hvd.Sum)).tolist()
    got["thread/after_reinit"] = _sequencer_running()
    hvd.shutdown()
    got["thread/at_end"] = _sequencer_running()
    record_rank(outdir, TAG, got=got)


def _sequencer_running() -> bool:
    """Whether this process has the kernels' sequencer thread (named in native/tf_sequencer.cc)."""
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return "sparktrain-seq" in names


def expected_many(r: int, n: int) -> list:
    ranks = range(n)
    rows = [(2 * n + 1) // n + (1 if q < (2 * n + 1) % n else 0) for q in ranks]
    gathered = np.concatenate([np.full([q + 1, 2], float(q)) for q in ranks])
    sent = [np.arange(2 * n, dtype=np.float32).reshape(2 * n, 1) + 100.0 * q for q in ranks]
    return [[float(sum(ranks))] * 3, [[n] * 2] * 2, [2.0 * sum(ranks)] * 3, gathered.tolist(), list(ranks),
            [[float(sum(q + 1 for q in ranks))] * 2] * rows[r], [float(n - 1)] * 4,
            np.concatenate([s[2 * r:2 * r + 2] for s in sent]).tolist(), [float(sum(ranks))] * 2, [sum(ranks)] * 3,
            [float(sum(ranks))], [2.0 * sum(ranks) / n] * 5]


def check_graph_ranks(ranks: dict, num_proc: int) -> None:
    """``graph_ranks``' records (``read_ranks(outdir, TAG)``) against numpy and the eager classes."""
    assert sorted(ranks) == list(range(num_proc))
    for r, info in ranks.items():
        got = info["got"]
        assert got["kernels"] is True
        assert got["many"] == expected_many(r, num_proc), (r, got["many"])
        assert got["many_again"] == got["many"]
        for case in ("plain", "fused", "grouped", "dtype", "root"):
            assert got[f"mismatch/{case}"] == "FailedPreconditionError", (r, case, got[f"mismatch/{case}"])
            assert got[f"after/{case}"] == [float(num_proc)] * 2, (r, case)
        for case in ("mismatch/plain", "mismatch/dtype", "mismatch/root", "bad/root"):
            assert got[case] == got[f"eager/{case}"], (r, case, got[case], got[f"eager/{case}"])
        assert got["bad/root"] == "InvalidArgumentError"
        assert got["eager/after"] == [float(num_proc)] * 2
        assert got["adasum"].startswith("InvalidArgumentError: allreduce(op=Adasum) in a TensorFlow 1 graph")
        assert "SPARKTRAIN_TF_KERNELS=0" in got["adasum"]
        stuck = got["stuck"]
        assert stuck.startswith("DeadlineExceededError: ") and (
            f"the ranks waited {STUCK_SECONDS:g} s for collectives of a TensorFlow 1 graph and could run none of them: "
            in stuck), (r, stuck)
        waits = re.findall(r"rank (\d+) waits for op (\d+) of graph (\d+)", stuck)
        assert [int(w[0]) for w in waits] == list(range(num_proc)) and len({w[2] for w in waits}) == 1, (r, stuck)
        ops = [int(w[1]) for w in waits]  # rank 0 built one more before it
        assert ops[0] == ops[1] + 1 and len(set(ops[1:])) == 1, (r, stuck)
        assert got["after/stuck"] == [float(num_proc)] * 2
        assert [got[f"thread/{when}"] for when in ("running", "after_shutdown", "after_reinit", "at_end")] == \
            [True, False, True, False], (r, got)
        assert got["after/reinit"] == [float(sum(range(num_proc)))] * 2
