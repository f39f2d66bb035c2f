"""Horovod's process sets on the native engine: every collective over sets {0, 2}, {1, 2}, {1} and
every rank side by side, eagerly, in tf.function and in a TensorFlow 1 graph, against numpy; ids,
add/remove, init(process_sets=), errors for non-members and bad sets; shared memory (one host)
and, in the multi-host tier, the TCP ring between hosts; nothing left after shutdown. Each run
records every rank's results; the tests assert per case."""
from __future__ import annotations

import os

import numpy as np
import pytest

import sparktrain
from helpers import plain, read_ranks, record_rank, recorder
from sparktrain import engine

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
SETS = {"a": [0, 2], "b": [1, 2], "c": [1], "g": [0, 1, 2]}
OPS = ("Sum", "Average", "Min", "Max", "Product")


def x_of(r: int, n: int = 6) -> np.ndarray:
    return (np.arange(n) % 4 + r - 1.5).astype(np.float32)


def listens() -> int:
    import psutil

    proc = psutil.Process()
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_LISTEN)


def tape_gradient(hvd, tf, ps, r: int):
    """The gradient of sum(w * (r + 1)) through DistributedGradientTape on ``ps``: averaged over
    the set's members, and this rank's own (r + 1) on a rank outside it."""
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as plain_tape:
        loss = tf.reduce_sum(w * float(r + 1))
    return hvd.DistributedGradientTape(plain_tape, process_set=ps).gradient(loss, [w])[0]


def collectives_on(hvd, tf, ps, name: str, r: int, put) -> None:
    """Every collective on ``ps``, eagerly, in a tf.function and through gradients."""
    m, root = ps.size(), ps.ranks[-1]

    def t(rows=6, dtype=tf.float32):
        return tf.cast(tf.constant(x_of(r, rows)), dtype)

    for op in OPS:
        put(f"{name}/allreduce/{op}", lambda: hvd.allreduce(t(), op=getattr(hvd, op), process_set=ps))
    put(f"{name}/allreduce/int_average", lambda: hvd.allreduce(tf.constant([r * 7 + 1]), process_set=ps))
    put(f"{name}/scaled", lambda: hvd.allreduce(t(), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25,
                                                process_set=ps))
    put(f"{name}/grouped_allreduce", lambda: hvd.grouped_allreduce([t(), t(2, tf.int32), t(3, tf.float64)],
                                                                   op=hvd.Sum, process_set=ps))
    put(f"{name}/sparse", lambda: tf.convert_to_tensor(hvd.allreduce(
        tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([3, 2])), process_set=ps)))
    put(f"{name}/allgather", lambda: hvd.allgather(tf.fill([r + 1, 2], float(r)), process_set=ps))
    put(f"{name}/grouped_allgather", lambda: hvd.grouped_allgather([t(r), tf.constant([r], tf.int8)], process_set=ps))
    put(f"{name}/broadcast", lambda: hvd.broadcast(t(), root_rank=root, process_set=ps))
    v = tf.Variable(t())
    put(f"{name}/broadcast_variables", lambda: [hvd.broadcast_variables([v], root_rank=root, process_set=ps), v][1])
    w = tf.Variable(t(4))
    put(f"{name}/broadcast_", lambda: hvd.broadcast_(w, root_rank=ps.ranks[0], process_set=ps))
    put(f"{name}/reducescatter", lambda: hvd.reducescatter(tf.reshape(t(10), [5, 2]), op=hvd.Sum, process_set=ps))
    put(f"{name}/grouped_reducescatter", lambda: hvd.grouped_reducescatter(
        [tf.reshape(t(10), [5, 2]), t(3)], op=hvd.Max, process_set=ps))
    splits = [k + 1 for k in range(m)]
    put(f"{name}/alltoall", lambda: hvd.alltoall(tf.range(sum(splits)) + 100 * r, splits=splits, process_set=ps))
    put(f"{name}/alltoall_even", lambda: hvd.alltoall(tf.range(2 * m) + 100 * r, process_set=ps))
    put(f"{name}/objects", lambda: [hvd.broadcast_object({"from": r} if r == root else None, root_rank=root,
                                                         process_set=ps),
                                    hvd.allgather_object("x" * r, process_set=ps)])
    put(f"{name}/barrier", lambda: [hvd.barrier(process_set=ps), 1][1])

    @tf.function
    def in_function(x):
        return (hvd.allreduce(x, op=hvd.Sum, process_set=ps), hvd.allgather(x, process_set=ps),
                hvd.broadcast(x, root_rank=root, process_set=ps),
                hvd.reducescatter(x, op=hvd.Max, process_set=ps),
                hvd.alltoall(x, splits=[6 - (m - 1)] + [1] * (m - 1), process_set=ps)[0])

    for step in range(2):
        put(f"{name}/function/{step}", lambda: in_function(t()))

    def gradients():
        x = tf.Variable(t(2))
        with tf.GradientTape(persistent=True) as tape:
            reduced = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, process_set=ps))
            gathered = tf.reduce_sum(hvd.allgather(x, process_set=ps) * tf.range(2.0 * m))
            broadcast = tf.reduce_sum(hvd.broadcast(x, root_rank=root, process_set=ps) * 3.0)
        rows = tf.Variable(tf.ones([2 * m]))
        per_rank = tf.Variable(tf.ones([m]))
        with tf.GradientTape(persistent=True) as more:
            scattered = tf.reduce_sum(hvd.reducescatter(rows, op=hvd.Sum, process_set=ps))
            exchanged = tf.reduce_sum(hvd.alltoall(per_rank, splits=[1] * m, process_set=ps)[0] *
                                      tf.range(1.0, m + 1.0))
        return [tape.gradient(y, x) for y in (reduced, gathered, broadcast)] + \
            [more.gradient(scattered, rows), more.gradient(exchanged, per_rank)]

    put(f"{name}/gradients", gradients)

    put(f"{name}/tape", lambda: tape_gradient(hvd, tf, ps, r))
    put(f"{name}/keras_optimizer", lambda: keras_step(ps, r))
    # Ranks that disagree: every member gets the engine's error, and the set goes on working.
    put(f"{name}/mismatch", lambda: hvd.allreduce(tf.ones([2 + ps.rank()]), process_set=ps))
    put(f"{name}/after_mismatch", lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, process_set=ps))
    put(f"{name}/bad_root", lambda: hvd.broadcast(t(), root_rank=[k for k in range(3) if k not in ps.ranks][0],
                                                  process_set=ps) if m < 3 else "all ranks")


def keras_step(ps, r: int):
    """One step of sparktrain.keras's DistributedOptimizer over ``ps``: SGD(1) from 0 by the
    gradient, averaged over the set's members (unreduced on other ranks)."""
    import keras
    import tensorflow as tf

    import sparktrain.keras as hvd_keras

    v = keras.Variable([0.0, 0.0])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=ps)
    opt.apply_gradients([(tf.constant([float(r + 1)] * 2), v)])
    return v


def tf1_on_sets(hvd, tf, a, b, r: int, got: dict) -> None:
    """A TensorFlow 1 graph with independent collectives on two sets and on every rank at once."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=12)
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        ops = [hvd.allreduce(tf.fill([2], float(r + k)), op=hvd.Sum) for k in range(2)]
        for ps in (a, b):
            if ps.included():
                ops += [hvd.allreduce(tf.fill([2], float(r + k)), op=hvd.Sum, process_set=ps) for k in range(3)]
                ops.append(hvd.allgather(tf.fill([1], float(r)), process_set=ps))
        got["tf1"] = [plain(v) for v in sess.run(ops)]
        try:
            sess.run(hvd.allreduce(tf.ones([2 + r]), process_set=a)) if a.included() else None
            got["tf1/mismatch"] = "no error" if a.included() else "not a member"
        except tf.errors.OpError as e:
            got["tf1/mismatch"] = type(e).__name__
        if a.included():
            got["tf1/after_mismatch"] = plain(sess.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum, process_set=a)))


def sets_rank(outdir):
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.engine import segment_name
    from sparktrain.tensorflow import process_sets

    listening_before = listens()
    a = hvd.ProcessSet([2, 0])
    hvd.init(process_sets=[a])
    r = hvd.rank()
    got: dict = {}
    put = recorder(got, r)

    b = hvd.add_process_set([1, 2])
    c = hvd.add_process_set(hvd.ProcessSet([1]))
    g = hvd.global_process_set
    sets = {"a": a, "b": b, "c": c, "g": g}
    got["ids"] = {k: [ps.process_set_id, ps.ranks, ps.size(), ps.included(), ps.rank() if ps.included() else None]
                  for k, ps in sets.items()}
    got["ops"] = [[int(hvd.size_op(ps.process_set_id)), int(hvd.process_set_included_op(ps.process_set_id))]
                  for ps in sets.values()]
    put("not_member_rank", lambda: a.rank())
    names = [process_sets._sets[ps.process_set_id].channel.name for ps in (a, b, c) if ps.included()]
    for name, ps in sets.items():
        if ps.included():
            collectives_on(hvd, tf, ps, name, r, put)
        else:
            put(f"{name}/not_member", lambda: hvd.allreduce(tf.ones([2]), process_set=ps))
            put(f"{name}/not_member_tape", lambda: tape_gradient(hvd, tf, ps, r))
            put(f"{name}/not_member_keras", lambda: keras_step(ps, r))
    tf1_on_sets(hvd, tf, a, b, r, got)
    # Add and remove: duplicates refused, ids reused, removal of the global set refused.
    put("duplicate", lambda: hvd.add_process_set([0, 2]))
    put("duplicate_global", lambda: hvd.add_process_set([0, 1, 2]))
    put("out_of_range", lambda: hvd.add_process_set([1, 3]))
    put("disagree", lambda: hvd.add_process_set([0, 1] if r == 0 else [0]))
    put("duplicate_on_one", lambda: hvd.add_process_set([0, 2] if r == 1 else [0, 1]))  # every rank raises
    got["remove"] = [hvd.remove_process_set(b), b.process_set_id, hvd.remove_process_set(b),
                     hvd.remove_process_set(g)]
    put("removed", lambda: hvd.allreduce(tf.ones([1]), process_set=b))
    again = hvd.add_process_set([2, 1])
    got["again"] = [again.process_set_id, again.ranks]
    put("again/allreduce", lambda: hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum, process_set=again)
        if again.included() else "not a member")
    names += [process_sets._sets[again.process_set_id].channel.name] if again.included() else []
    hvd.shutdown()
    got["left_shm"] = [n for n in names for k in range(3) if os.path.exists("/dev/shm" + segment_name(n, k))]
    got["listening"] = [listening_before, listens()]
    got["after_shutdown"] = [a.process_set_id, process_sets._sets == {}]
    # Sets may be given again at a new init; the ids start over.
    hvd.init(process_sets=[hvd.ProcessSet([0, 1])])
    put("reinit", lambda: [hvd.global_process_set.size(), len(process_sets._sets)])
    hvd.shutdown()
    record_rank(outdir, got=got, names=len(names))


def check_sets(got: dict, tcp: bool) -> list:
    bad = []

    def expect(case, r, want):
        if got[r].get(case) != want:
            bad.append((case, r, got[r].get(case), want))

    def error(case, r, cls, *words):
        value = got[r].get(case, "")
        if not (isinstance(value, str) and value.startswith(f"ERROR {cls}") and all(w in value for w in words)):
            bad.append((case, r, value, (cls, words)))

    for r in range(3):
        expect("ids", r, {"a": [1, [0, 2], 2, r in (0, 2), {0: 0, 2: 1}.get(r)],
                          "b": [2, [1, 2], 2, r in (1, 2), {1: 0, 2: 1}.get(r)],
                          "c": [3, [1], 1, r == 1, 0 if r == 1 else None],
                          "g": [0, [0, 1, 2], 3, True, r]})
        expect("ops", r, [[2, int(r != 1)], [2, int(r != 0)], [1, int(r == 1)], [3, 1]])
        if r == 1:
            error("not_member_rank", r, "InvalidArgumentError", "rank 1 is not part of")
        for name, ranks in SETS.items():
            if r not in ranks:
                error(f"{name}/not_member", r, "InvalidArgumentError", f"rank {r} is not a member")
                expect(f"{name}/not_member_tape", r, [float(r + 1)] * 2)  # unreduced, as Horovod's
                expect(f"{name}/not_member_keras", r, [-float(r + 1)] * 2)
                continue
            check_set(got, r, name, ranks, expect, error)
        check_tf1(got, r, expect)
        error("duplicate", r, "InvalidArgumentError", "duplicate", "process set 1")
        error("duplicate_global", r, "InvalidArgumentError", "duplicate", "global_process_set")
        error("out_of_range", r, "InvalidArgumentError", "0..2")
        error("disagree", r, "InvalidArgumentError", "ranks [", "same order")
        error("duplicate_on_one", r, "InvalidArgumentError", *(["duplicate", "process set 1"] if r == 1 else
                                                               ["ranks [1] refused", "a duplicate there"]))
        expect("remove", r, [True, None, False, False])
        error("removed", r, "InvalidArgumentError", "not registered")
        expect("again", r, [2, [1, 2]])
        expect("again/allreduce", r, [3.0] if r in (1, 2) else "not a member")
        expect("left_shm", r, [])
        expect("after_shutdown", r, [None, True])
        expect("reinit", r, [3, 1])
        if tcp:  # every set's ring listened, then closed its listener
            l_before, l_after = got[r]["listening"]
            if l_after != l_before:
                bad.append(("listening", r, got[r]["listening"], "as before init"))
    return bad


def check_set(got, r, name, ranks, expect, error) -> None:
    m, me = len(ranks), ranks.index(r)
    xs = np.stack([x_of(k) for k in ranks])
    want = {"Sum": xs.sum(0), "Average": xs.sum(0) / m, "Min": xs.min(0), "Max": xs.max(0), "Product": xs.prod(0)}
    for op in OPS:
        value = got[r][f"{name}/allreduce/{op}"]
        if isinstance(value, str) or not np.allclose(value, want[op], rtol=1e-5):
            expect(f"{name}/allreduce/{op}", r, plain(want[op]))
    expect(f"{name}/allreduce/int_average", r, [float(np.trunc(sum(k * 7 + 1 for k in ranks) / m))])
    expect(f"{name}/scaled", r, plain(xs.sum(0) * 2.0 * 0.25))
    expect(f"{name}/grouped_allreduce", r, [plain(xs.sum(0)), plain(sum(x_of(k, 2).astype(np.int32) for k in ranks)),
                                            plain(sum(x_of(k, 3).astype(np.float64) for k in ranks))])
    dense = np.zeros((3, 2), np.float32)
    for k in ranks:
        dense[k] += np.float32(k + 1) / np.float32(m)  # divided in float32, as the values are
    expect(f"{name}/sparse", r, plain(dense))
    expect(f"{name}/allgather", r, plain(np.concatenate([np.full((k + 1, 2), float(k)) for k in ranks])))
    expect(f"{name}/grouped_allgather", r, [plain(np.concatenate([x_of(k, k) for k in ranks])),
                                            [float(k) for k in ranks]])
    root = ranks[-1]
    expect(f"{name}/broadcast", r, plain(x_of(root)))
    expect(f"{name}/broadcast_variables", r, plain(x_of(root)))
    expect(f"{name}/broadcast_", r, plain(x_of(ranks[0], 4)))
    rows = [5 // m + (1 if k < 5 % m else 0) for k in range(m)]
    full = sum(x_of(k, 10) for k in ranks).reshape(5, 2)
    expect(f"{name}/reducescatter", r, plain(full[sum(rows[:me]):sum(rows[:me + 1])]))
    mx = np.max([x_of(k, 10) for k in ranks], 0).reshape(5, 2)
    rows3 = [3 // m + (1 if k < 3 % m else 0) for k in range(m)]
    mx3 = np.max([x_of(k, 3) for k in ranks], 0)
    expect(f"{name}/grouped_reducescatter", r, [plain(mx[sum(rows[:me]):sum(rows[:me + 1])]),
                                                plain(mx3[sum(rows3[:me]):sum(rows3[:me + 1])])])
    splits = [k + 1 for k in range(m)]
    start = sum(splits[:me])
    expect(f"{name}/alltoall", r, [[float(100 * k + j) for k in ranks for j in range(start, start + splits[me])],
                                   [float(s) for s in [me + 1] * m]])
    expect(f"{name}/alltoall_even", r, [float(100 * k + j) for k in ranks for j in range(2 * me, 2 * me + 2)])
    expect(f"{name}/objects", r, [{"from": root}, ["x" * k for k in ranks]])
    expect(f"{name}/barrier", r, 1)
    split = [6 - (m - 1)] + [1] * (m - 1)
    starts = np.cumsum([0] + split)
    rs = [6 // m + (1 if k < 6 % m else 0) for k in range(m)]
    for step in range(2):
        expect(f"{name}/function/{step}", r, [
            plain(xs.sum(0)), plain(np.concatenate(list(xs))), plain(x_of(root)),
            plain(xs.max(0)[sum(rs[:me]):sum(rs[:me + 1])]),
            plain(np.concatenate([x_of(k)[starts[me]:starts[me] + split[me]] for k in ranks]))])
    # d/dx sum(allreduce_sum(x)) = m; allgather: my rows of the (same on every rank) weights;
    # broadcast: 3 (averaged over the set) on the root, 0 elsewhere; reducescatter (Sum): the set's
    # size on every row; alltoall: each member sends back this rank's weight, me + 1.
    expect(f"{name}/gradients", r, [[float(m)] * 2, [2.0 * me, 2.0 * me + 1],
                                    [3.0 if r == root else 0.0] * 2, [float(m)] * (2 * m), [me + 1.0] * m])
    mean = sum(k + 1 for k in ranks) / m
    expect(f"{name}/tape", r, [mean, mean])
    expect(f"{name}/keras_optimizer", r, [-mean, -mean])
    if name == "g":
        error(f"{name}/mismatch", r, "FailedPreconditionError", "rank 0 passed float32[2]")
    elif m > 1:  # the engine numbers a set's ranks from 0: the error says which global ranks they are
        error(f"{name}/mismatch", r, "FailedPreconditionError", f"global ranks {ranks}, numbered 0..{m - 1}",
              "rank 0 passed float32[2]")
    expect(f"{name}/after_mismatch", r, [float(m)] * 2)
    if m < 3:
        error(f"{name}/bad_root", r, "InvalidArgumentError", "root_rank", str(ranks))


def check_tf1(got, r, expect) -> None:
    want = [[float(sum(range(3)) + 3 * k)] * 2 for k in range(2)]
    for ranks in (SETS["a"], SETS["b"]):
        if r in ranks:
            want += [[float(sum(ranks) + 2 * k)] * 2 for k in range(3)] + [[float(k) for k in ranks]]
    expect("tf1", r, want)
    if r in SETS["a"]:
        if got[r]["tf1/mismatch"] not in ("FailedPreconditionError", "UnknownError"):
            expect("tf1/mismatch", r, "FailedPreconditionError")
        expect("tf1/after_mismatch", r, [2.0, 2.0])


def run_sets(tmp_path, env: dict, num_proc: int = -3) -> dict:
    """``sets_rank`` on 3 ranks (``num_proc``: negative, in local mode; 3, through Spark)."""
    sparktrain.run(sets_rank, args=(str(tmp_path),), num_proc=num_proc, env={**ENV, **env}, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    assert all(info["names"] >= 1 for info in ranks.values())  # every rank had set communicators
    return {r: info["got"] for r, info in ranks.items()}


@pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))
def test_every_collective_on_process_sets_side_by_side(tmp_path):
    """On one host: every set's communicator shares memory. The multi-host tier runs the same
    ranks across hosts, where the sets join TCP rings (test_multihost.py); TensorFlow's ring
    refusing process sets is checked with its other collectives (test_hvd_collectives.py)."""
    got = run_sets(tmp_path, {})
    assert check_sets(got, tcp=False) == []


def test_process_set_objects_in_this_process():
    """What needs no ranks: the objects, their checks, and the global set (a run of one)."""
    import sparktrain.tensorflow as hvd

    ps = hvd.ProcessSet(np.array([3, 1]))
    assert (ps.ranks, ps.process_set_id, ps.size(), ps.rank(), repr(ps)) == \
        ([1, 3], None, None, None, "ProcessSet(process_set_id=None, ranks=[1, 3])")
    for bad, words in ((5, "list of ranks"), ("01", "list of ranks"), ([0, -1], "ints >= 0"), ([True], "ints >= 0"),
                       ([2, 2], "names a rank twice")):
        with pytest.raises(sparktrain.InvalidArgumentError, match=words):
            hvd.ProcessSet(bad)
    g = hvd.global_process_set
    assert (g.process_set_id, g.ranks, g.size(), g.rank(), g.included()) == (0, [0], 1, 0, True)
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"process_sets=\[\[0\]\]\): pass a list of"):
        hvd.init(process_sets=[[0]])
    was = hvd.is_initialized()
    hvd.init(process_sets="dynamic")
    try:
        with pytest.raises(sparktrain.InvalidArgumentError, match="duplicate process set.*global_process_set"):
            hvd.add_process_set([0])
        assert hvd.remove_process_set(g) is False and hvd.remove_process_set(ps) is False
        assert int(hvd.size_op()) == 1 and int(hvd.process_set_included_op(0)) == 1
        with pytest.raises(sparktrain.InvalidArgumentError, match=r"size_op\(process_set_id=4\): no such"):
            hvd.size_op(4)
        with pytest.raises(sparktrain.InvalidArgumentError, match="is not registered; add it on every rank"):
            hvd.allreduce([1.0], process_set=ps)
        with pytest.raises(sparktrain.InvalidArgumentError, match="process_set must be a sparktrain"):
            hvd.allgather([1.0], process_set=[0])
    finally:
        if not was:
            hvd.shutdown()
