"""Horovod's ``horovod.tensorflow`` collectives in ``sparktrain.tensorflow``, against numpy: every
op and dtype, ragged and empty inputs, eagerly and inside tf.function, on 2 and 3 ranks, on the
native engine and on TensorFlow's ring; in the 3-rank runs, gradients, tapes and mismatches too
(hvd_gradient_ranks.py). One run per configuration checks everything and records it; the tests
assert per case."""
from __future__ import annotations

import json
import pickle
import os

import numpy as np
import pytest

import sparktrain
from helpers import plain, read_ranks, record_rank, recorder
from hvd_gradient_ranks import GRAD, check_gradients, check_mismatches
from tf1_graph_kernels import TAG, check_graph_ranks
from sparktrain import engine
from sparktrain.errors import InvalidArgumentError

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "SPARKTRAIN_COLLECTIVE_TIMEOUT": "60"}
RING = {"SPARKTRAIN_CPU_COLLECTIVES": "tensorflow", "PYTHONFAULTHANDLER": "1"}
DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
OPS = ("Sum", "Average", "Min", "Max", "Product")


def inputs(r: int, dtype: str, n: int = 6) -> np.ndarray:
    """Rank ``r``'s input: small values every dtype holds exactly (negatives for signed types)."""
    base = np.arange(n) % 3 + r
    if dtype == "bool":
        return (np.arange(n) + r) % 2 == 0
    if dtype.startswith("uint"):
        return base.astype(np.int64)
    return (base - 2).astype(np.int64) if "int" in dtype else (base - 1.5)


def expected_reduce(op: str, dtype: str, size: int, n: int = 6):
    stack = np.stack([inputs(r, dtype, n) for r in range(size)])
    if dtype == "bool":
        return (np.any(stack, 0) if op in ("Sum", "Max") else np.all(stack, 0)).tolist()
    if op == "Sum":
        out = stack.sum(0)
    elif op == "Min":
        out = stack.min(0)
    elif op == "Max":
        out = stack.max(0)
    elif op == "Product":
        out = stack.prod(0)
    else:
        out = stack.sum(0) / size
        if dtype not in ("float16", "bfloat16", "float32", "float64"):
            out = np.trunc(out)
    return out.astype(np.float64).tolist()


def adasum(parts):
    level = [np.asarray(p, np.float64) for p in parts]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot = a @ b
            nxt.append((1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def everything(outdir, gradients=None):
    """Every collective this rank can run, recorded as {case: value or error}; first, with
    ``gradients`` ("plain", or "mismatches" too), hvd_gradient_ranks' cases, which call ``init``
    themselves, inside a function."""
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    if gradients:
        from hvd_gradient_ranks import gradient_ranks

        gradient_ranks(outdir, gradients == "mismatches")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    got: dict = {}
    put = recorder(got, r)

    def t(dtype, rows=6, rank=None):
        return tf.cast(tf.constant(inputs(r if rank is None else rank, dtype, rows)), dtype)

    for dtype in DTYPES:
        for op in OPS:
            if dtype == "bool" and op == "Average":
                continue
            put(f"allreduce/{op}/{dtype}", lambda: hvd.allreduce(t(dtype), op=getattr(hvd, op)))
        put(f"allgather/{dtype}", lambda: hvd.allgather(tf.reshape(t(dtype, 2 * (r + 1)), [r + 1, 2])))
        put(f"broadcast/{dtype}", lambda: hvd.broadcast(t(dtype), root_rank=1))
        put(f"alltoall/{dtype}", lambda: hvd.alltoall(t(dtype, n * r), splits=[r] * n))
    for dtype in ("float32", "float64"):
        put(f"allreduce/Adasum/{dtype}", lambda: hvd.allreduce(t(dtype), op=hvd.Adasum))
    for dtype in ("float32", "int32", "uint8", "bool"):
        for op in ("Sum", "Average", "Max"):
            if dtype == "bool" and op == "Average":
                continue
            put(f"reducescatter/{op}/{dtype}", lambda: hvd.reducescatter(tf.reshape(t(dtype, 10), [5, 2]),
                                                                        op=getattr(hvd, op)))
    put("reducescatter/short", lambda: hvd.reducescatter(tf.ones([2, 3]), op=hvd.Sum))  # fewer rows than ranks
    put("allgather/empty", lambda: hvd.allgather(tf.zeros([0 if r == 1 else 2, 3])))
    put("allgather/scalar", lambda: hvd.allgather(tf.constant(float(r))))
    put("alltoall/even", lambda: hvd.alltoall(tf.range(2 * n) + 10 * r))  # without splits: received alone
    put("alltoall/even_empty", lambda: hvd.alltoall(tf.zeros([n, 0], tf.int8)))
    put("alltoall/zero", lambda: hvd.alltoall(tf.zeros([0, 2]), splits=[0] * n))
    # Without splits in a function whose rows are known only when it runs: split evenly then.
    unknown_rows = tf.function(hvd.alltoall, input_signature=[tf.TensorSpec([None], tf.int32)])
    put("alltoall/even_unknown_rows", lambda: unknown_rows(tf.range(2 * n) + 10 * r))
    put("alltoall/uneven_unknown_rows", lambda: unknown_rows(tf.range(2 * n + 1)))
    put("grouped_allreduce", lambda: hvd.grouped_allreduce([t("float32"), t("int32"), t("float64", 2)], op=hvd.Sum))
    put("grouped_allgather", lambda: hvd.grouped_allgather([t("float32", r), t("int8", 1)]))
    put("grouped_reducescatter", lambda: hvd.grouped_reducescatter([tf.ones([n, 2]) * r, tf.ones([n]) * r], op=hvd.Sum))
    put("scaled", lambda: hvd.allreduce(t("float32"), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 / n))
    # Horovod scales float16 in float32 and rounds once: the same tensor on every rank, n times.
    put("scaled/float16", lambda: hvd.allreduce(tf.constant(inputs(0, "float16"), tf.float16), op=hvd.Sum,
                                                prescale_factor=0.3))
    # float64 scaled by the factor itself, not by its float32 rounding (0.3 is not a float32).
    put("scaled/float64", lambda: hvd.allreduce(t("float64"), op=hvd.Sum, prescale_factor=0.3, postscale_factor=0.7))
    put("average_true", lambda: hvd.allreduce(t("float32"), average=True))
    put("average_false", lambda: hvd.allreduce(t("float32"), average=False))
    put("fp16", lambda: hvd.allreduce(t("float64"), op=hvd.Sum, compression=hvd.Compression.fp16))
    put("fp16_dtype", lambda: hvd.Compression.fp16.compress(t("float64"))[0].dtype.name)

    def sparse():
        values = tf.fill([1, 2], tf.constant(r + 1.0, tf.float64))
        s = hvd.allreduce(tf.IndexedSlices(values, tf.constant([r]), tf.constant([n, 2])))
        return [s.values, s.indices, tf.convert_to_tensor(s)]
    put("sparse", sparse)

    @tf.function
    def in_graph(x, b):
        return (hvd.allreduce(x, op=hvd.Max), hvd.allreduce(b, op=hvd.Min), hvd.allgather(x),
                hvd.broadcast(b, root_rank=2 % n), hvd.reducescatter(x, op=hvd.Sum),
                hvd.alltoall(x, splits=[2] + [1] * (n - 2) + [6 - n])[0], hvd.allreduce(x, op=hvd.Adasum))

    for step in range(2):  # the traced function runs again with its fixed keys
        put(f"graph/{step}", lambda: in_graph(t("float32"), t("bool")))
    @tf.function
    def every_dtype_in_graph():
        return [hvd.allreduce(t(dtype), op=hvd.Max if dtype == "bool" else hvd.Sum) for dtype in DTYPES]

    put("graph/dtypes", every_dtype_in_graph)
    v = tf.Variable(t("float32"))
    put("broadcast_", lambda: [hvd.broadcast_([v], root_rank=1)[0], v])  # the value returned, and assigned
    if os.environ.get("SPARKTRAIN_CPU_COLLECTIVES") == "tensorflow":
        try:  # TensorFlow's ring has no TensorFlow 1 graph path: a clear error, not a hang
            with tf.Graph().as_default():
                hvd.allreduce(tf.ones([2]))
            got["tf1"] = "no error"
        except InvalidArgumentError as e:
            got["tf1"] = str(e)
        for case, fn in {"ring/init_sets": lambda: hvd.init(process_sets=[hvd.ProcessSet([0])]),
                         "ring/add_set": lambda: hvd.add_process_set([1])}.items():
            put(case, fn)  # process sets need the native engine: refused, naming the fix
    else:
        tf1_graph(hvd, got, r, n)
    put("broadcast_object", lambda: hvd.broadcast_object({"from": r, "x": [1, 2]} if r == 1 else None, root_rank=1))
    put("broadcast_object_fn", lambda: hvd.broadcast_object_fn(root_rank=0)(f"rank{r}"))
    put("allgather_object", lambda: hvd.allgather_object({"r": r, "s": "x" * r}))
    put("ids", lambda: [int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_rank_op()), int(hvd.local_size_op()),
                        hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()])
    put("built", lambda: [hvd.mpi_built(), hvd.gloo_built(), hvd.mpi_enabled(), hvd.gloo_enabled(),
                          hvd.mpi_threads_supported(), hvd.ddl_built(), hvd.ccl_built(), hvd.nccl_built(),
                          hvd.cuda_built(), hvd.rocm_built()])
    put("join", lambda: int(hvd.join()))
    # Bad input: clear errors naming the value.
    put("bad/op", lambda: hvd.allreduce(t("float32"), op="mean"))
    put("bad/both", lambda: hvd.allreduce(t("float32"), op=hvd.Sum, average=True))
    put("bad/root", lambda: hvd.broadcast(t("float32"), root_rank=n))
    put("bad/splits", lambda: hvd.alltoall(t("float32"), splits=[1] * n))
    # Horovod's NotImplementedError: Min of IndexedSlices, or scaled ones.
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    put("unsupported/sparse_min", lambda: hvd.allreduce(slices, op=hvd.Min))
    put("unsupported/sparse_scaled", lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=2.0))
    put("bad/bool_average", lambda: hvd.allreduce(t("bool")))
    put("bad/adasum_int", lambda: hvd.allreduce(t("int32"), op=hvd.Adasum))
    put("bad/init_comm", lambda: hvd.init(comm=[0, 1]))
    put("bad/init_sets", lambda: hvd.init(process_sets=[[0, 1]]))
    # Timeline: every collective between start and stop, one event each.
    timeline = os.path.join(outdir, "timeline.json")
    hvd.start_timeline(timeline)
    hvd.allreduce(t("float32"), op=hvd.Sum)
    hvd.allgather(t("int32"))
    hvd.broadcast(t("float64"), root_rank=0, name="weights")
    tf.function(lambda x: hvd.allreduce(x, op=hvd.Max))(t("int8"))  # recorded on the native engine only
    got["timeline"] = hvd.stop_timeline()
    # shutdown closes the engine; init brings it up again. A function traced before runs on
    # the new one (on the native engine; TensorFlow's ring keeps its instance keys).
    traced = tf.function(lambda: hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum))
    put("traced", traced)
    hvd.shutdown()
    got["after_shutdown"] = hvd.is_initialized()
    if os.environ.get("SPARKTRAIN_CPU_COLLECTIVES") != "tensorflow":
        put("traced_after_shutdown", traced)
    with tf.Graph().as_default():  # init may come first in a graph; eager collectives find it after
        hvd.init()
    put("reinit", lambda: hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum))
    if os.environ.get("SPARKTRAIN_CPU_COLLECTIVES") != "tensorflow":
        put("traced_after_reinit", traced)
    record_rank(outdir, got=got, engine=hvd.collective_engine(), kernels=hvd.collective_kernels())
    if hvd.collective_kernels():  # TensorFlow 1 graphs through the kernels and their sequencer
        from tf1_graph_kernels import graph_ranks

        graph_ranks(outdir)


def tf1_graph(hvd, got: dict, r: int, n: int) -> None:
    """Collectives in a TensorFlow 1 graph run by a session, where ops that do not depend on each
    other run in any order: several collectives of one call, of the same shape and dtype, must still
    meet their own peers."""
    import tensorflow as tf

    # Each collective a step runs holds one of the session's threads until every rank runs it.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=12)
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        rows = [tf.fill([n * 2, 3], float(10 * k + r)) for k in range(5)]
        scattered = hvd.grouped_reducescatter(rows, op=hvd.Sum)
        gathered = hvd.grouped_allgather([tf.fill([2], float(10 * k + r)) for k in range(5)])
        reduced = hvd.grouped_allreduce([tf.fill([3], float(k + r)) for k in range(3)] +
                                        [tf.fill([3], k + r) for k in range(3)], op=hvd.Sum)
        x = tf.constant([[float(r)] * 2] * (r + 1))
        gradient = tf.gradients(hvd.allgather(x) * 2.0, x)[0]
        values = tf.compat.v1.get_variable("w", initializer=tf.fill([4], float(r)), use_resource=True)
        inplace = tf.compat.v1.get_variable("v", initializer=tf.fill([4], float(r)), use_resource=True)
        sess.run(tf.compat.v1.global_variables_initializer())
        got["tf1/grouped"] = [[plain(a) for a in sess.run(scattered)], [plain(a) for a in sess.run(gathered)],
                              [plain(a) for a in sess.run(reduced)], plain(sess.run(gradient))]
        # Independent ops of one step, same shapes and different ones, run in any order on each rank.
        independent = [hvd.allreduce(tf.fill([1 + k % 3], float(k * r)), op=hvd.Sum) for k in range(9)]
        got["tf1/independent"] = [plain(a) for a in sess.run(independent)]
        try:
            sess.run(hvd.allreduce(tf.ones([2 + r])))
            got["tf1/mismatch"] = "no error"
        except tf.errors.OpError as e:
            got["tf1/mismatch"] = type(e).__name__
        got["tf1/kernels"] = hvd.collective_kernels()
        got["tf1/after_mismatch"] = plain(sess.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum)))
        returned = hvd.broadcast_(inplace, root_rank=n - 1)
        got["tf1/broadcast_"] = [plain(sess.run(returned)), plain(sess.run(inplace))]
        sess.run(hvd.broadcast_global_variables(1))
        got["tf1/global_variables"] = [plain(sess.run(values)), plain(sess.run(inplace))]
        # Object collectives build their ops and run them in the default session, as Horovod's do.
        got["tf1/objects"] = [hvd.allgather_object({"r": r, "s": "x" * r}),
                              hvd.broadcast_object({"from": r} if r == n - 1 else None, root_rank=n - 1)]
    with tf.Graph().as_default():  # no session: they run in one of their own
        got["tf1/objects_own_session"] = hvd.allgather_object(r)
    try:
        tf.function(lambda: hvd.allgather_object(r))()
        got["tf1/objects_in_function"] = "no error"
    except InvalidArgumentError as e:
        got["tf1/objects_in_function"] = str(e)


def run_all(tmp_path, num_proc, env, gradients=None):
    sparktrain.run(everything, args=(str(tmp_path), gradients), num_proc=-num_proc, env={**ENV, **env}, verbose=0)
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == list(range(num_proc))
    return {r: info["got"] for r, info in ranks.items()}, {(info["engine"], info["kernels"]) for info in ranks.values()}


def check_tf1_graph(got: dict, r: int, n: int, expect) -> None:
    """``tf1_graph``'s results on rank ``r`` against numpy."""
    sums = [float(sum(10 * k + q for q in range(n))) for k in range(5)]
    expect("tf1/grouped", r, [[[[s] * 3] * 2 for s in sums],
                              [[float(10 * k + q) for q in range(n) for _ in range(2)] for k in range(5)],
                              [[float(sum(k + q for q in range(n)))] * 3 for k in range(3)] * 2,
                              [[2.0] * 2] * (r + 1)])
    expect("tf1/independent", r, [[float(k * sum(range(n)))] * (1 + k % 3) for k in range(9)])
    # The kernels raise the engine's class, as eagerly; numpy_function's may wrap it in an UnknownError.
    classes = ("FailedPreconditionError",) if got[r]["tf1/kernels"] else ("FailedPreconditionError", "UnknownError")
    assert got[r]["tf1/mismatch"] in classes, got[r]["tf1/mismatch"]
    expect("tf1/after_mismatch", r, [float(n)] * 2)
    expect("tf1/broadcast_", r, [[float(n - 1)] * 4] * 2)
    expect("tf1/global_variables", r, [[1.0] * 4, [float(n - 1)] * 4])
    expect("tf1/objects", r, [[{"r": q, "s": "x" * q} for q in range(n)], {"from": n - 1}])
    expect("tf1/objects_own_session", r, list(range(n)))
    assert "cannot return; call it eagerly" in got[r]["tf1/objects_in_function"], got[r]["tf1/objects_in_function"]


def check_everything(got: dict, n: int, tmp_path, engine: str) -> list:
    """Every case against numpy; returns the failures (case, rank, got, expected)."""
    bad = []

    def expect(case, r, value):
        if got[r][case] != value:
            bad.append((case, r, got[r][case], value))

    for r in range(n):
        for dtype in DTYPES:
            for op in OPS:
                if dtype == "bool" and op == "Average":
                    continue
                expect(f"allreduce/{op}/{dtype}", r, expected_reduce(op, dtype, n))
            gathered = np.concatenate([inputs(k, dtype, 2 * (k + 1)).reshape(k + 1, 2) for k in range(n)])
            expect(f"allgather/{dtype}", r, plain(gathered))
            expect(f"broadcast/{dtype}", r, plain(inputs(1, dtype)))
            # Rank k sends k rows to every rank: rows k*r .. k*r+k of its input come here.
            rows = np.concatenate([inputs(k, dtype, n * k)[k * r:k * r + k] for k in range(n)])
            expect(f"alltoall/{dtype}", r, [plain(rows), [float(k) for k in range(n)]])
        for dtype in ("float32", "float64"):
            want = adasum([inputs(k, dtype) for k in range(n)])
            assert np.allclose(got[r][f"allreduce/Adasum/{dtype}"], want, rtol=1e-5), (r, dtype)
        split = [5 // n + (1 if k < 5 % n else 0) for k in range(n)]
        start = sum(split[:r])
        for dtype in ("float32", "int32", "uint8", "bool"):
            for op in ("Sum", "Average", "Max"):
                if dtype == "bool" and op == "Average":
                    continue
                full = np.array(expected_reduce(op, dtype, n, 10)).reshape(5, 2)
                expect(f"reducescatter/{op}/{dtype}", r, full[start:start + split[r]].tolist())
        short = [2 // n + (1 if k < 2 % n else 0) for k in range(n)]
        expect("reducescatter/short", r, [[float(n)] * 3] * short[r])
        expect("allgather/empty", r, [[0.0] * 3] * (2 * (n - 1)))
        expect("allgather/scalar", r, [float(k) for k in range(n)])
        expect("alltoall/even", r, [float(10 * k + 2 * r + j) for k in range(n) for j in range(2)])
        expect("alltoall/even_unknown_rows", r, [float(10 * k + 2 * r + j) for k in range(n) for j in range(2)])
        uneven = got[r]["alltoall/uneven_unknown_rows"]
        assert uneven.startswith("ERROR InvalidArgumentError") and f"do not divide by {n}" in uneven, uneven
        expect("alltoall/even_empty", r, [[]] * n)
        expect("alltoall/zero", r, [[], [0.0] * n])
        expect("grouped_allreduce", r, [expected_reduce("Sum", "float32", n), expected_reduce("Sum", "int32", n),
                                        expected_reduce("Sum", "float64", n, 2)])
        expect("grouped_allgather", r, [plain(np.concatenate([inputs(k, "float32", k) for k in range(n)])),
                                        plain(np.concatenate([inputs(k, "int8", 1) for k in range(n)]))])
        total = float(sum(range(n)))
        expect("grouped_reducescatter", r, [[[total] * 2], [total]])
        assert np.allclose(got[r]["scaled"], np.array(expected_reduce("Sum", "float32", n)) / n), r
        once = (inputs(0, "float16").astype(np.float32) * np.float32(0.3)).astype(np.float16)
        expect("scaled/float16", r, plain(once * np.float16(n)))
        # Within float64's rounding of a sum (1e-16); the factors rounded to float32 were off by 1e-8.
        want = sum(inputs(k, "float64") * 0.3 for k in range(n)) * 0.7
        assert np.allclose(got[r]["scaled/float64"], want, rtol=1e-13, atol=0), (r, got[r]["scaled/float64"], want)
        expect("average_true", r, expected_reduce("Average", "float32", n))
        expect("average_false", r, expected_reduce("Sum", "float32", n))
        expect("fp16", r, expected_reduce("Sum", "float64", n))
        expect("fp16_dtype", r, "float16")
        values = [[float(k + 1) / n] * 2 for k in range(n)]
        dense = [[float(k + 1) / n] * 2 for k in range(n)]
        expect("sparse", r, [values, [float(k) for k in range(n)], dense])
        x = [inputs(k, "float32") for k in range(n)]
        b = [inputs(k, "bool") for k in range(n)]
        splits = [2] + [1] * (n - 2) + [6 - n]
        starts = np.cumsum([0] + splits)
        mine = np.concatenate([x[k][starts[r]:starts[r] + splits[r]] for k in range(n)])
        rs = [6 // n + (1 if k < 6 % n else 0) for k in range(n)]
        for step in range(2):
            g = got[r][f"graph/{step}"]
            assert g[:6] == [plain(np.max(x, 0)), plain(np.all(b, 0)), plain(np.concatenate(x)), plain(b[2 % n]),
                             plain(np.sum(x, 0)[sum(rs[:r]):sum(rs[:r + 1])]), plain(mine)], (r, step, g)
            assert np.allclose(g[6], adasum(x), rtol=1e-5), (r, step)
        expect("graph/dtypes", r, [expected_reduce("Max" if d == "bool" else "Sum", d, n) for d in DTYPES])
        expect("broadcast_", r, [plain(inputs(1, "float32"))] * 2)
        if "tf1" in got[r]:  # TensorFlow's ring
            assert "SPARKTRAIN_CPU_COLLECTIVES=native" in got[r]["tf1"], got[r]["tf1"]
            for case in ("ring/init_sets", "ring/add_set"):
                text = got[r][case]
                assert text.startswith("ERROR UnsupportedError") and "native" in text and \
                    "SPARKTRAIN_CPU_COLLECTIVES" in text, (case, text)
        else:
            check_tf1_graph(got, r, n, expect)
        expect("broadcast_object", r, {"from": 1, "x": [1, 2]})
        expect("broadcast_object_fn", r, "rank0")
        expect("allgather_object", r, [{"r": k, "s": "x" * k} for k in range(n)])
        expect("ids", r, [r, n, r, n, 0, 1, True])
        expect("built", r, [False] * 7 + [got[r]["built"][8]] * 2 + [False])
        assert got[r]["join"] in range(n), got[r]["join"]
        # Splits that do not match the rows: also TensorFlow's InvalidArgumentError, as Horovod's op raises.
        assert got[r]["bad/splits"].startswith("ERROR SplitsError") and "[1, 1" in got[r]["bad/splits"]
        for case, words in {"bad/op": ["'mean'", "Average, Sum"], "bad/both": ["op supersedes", "average=True"],
                            "bad/root": [f"0..{n - 1}", f"got {n}"],
                            "bad/bool_average": ["bool", "Average"], "bad/adasum_int": ["Adasum", "int32"],
                            "bad/init_comm": ["comm=[0, 1]", "without comm"],
                            "bad/init_sets": ["process_sets=[[0, 1]]", "list of sparktrain.tensorflow.ProcessSet"]}.items():
            assert got[r][case].startswith("ERROR InvalidArgumentError") and all(w in got[r][case] for w in words), \
                (case, got[r][case])
        for case, words in {"unsupported/sparse_min": ["Sum or Average, got Min", "sparse_as_dense=True"],
                            "unsupported/sparse_scaled": ["prescale_factor", "sparse_as_dense=True"]}.items():
            assert got[r][case].startswith("ERROR UnsupportedError") and all(w in got[r][case] for w in words), \
                (case, got[r][case])
        path = got[r]["timeline"]
        assert path == str(tmp_path / ("timeline.json" if r == 0 else f"timeline.rank{r}.json"))
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        in_function = [("allreduce.max", 6)] if engine == "native" else []
        assert [(e["name"], e["args"]["bytes"]) for e in events] == \
            [("allreduce.sum", 24), ("allgather", 24), ("weights", 48)] + in_function, events
        assert all(e["pid"] == r for e in events)
        assert all(e["dur"] >= 0 and e["ts"] > 1.6e15 for e in events)
        expect("after_shutdown", r, False)
        expect("reinit", r, [total])
        expect("traced", r, [total])
        if engine == "native":
            expect("traced_after_reinit", r, [total])
            after = got[r]["traced_after_shutdown"]
            # The kernels find no engine; numpy_function calls the closed communicator.
            if not (after.startswith("ERROR ") and ("init()" in after or "closed" in after)):
                bad.append(("traced_after_shutdown", r, after, "an error naming init()"))
    assert len({got[r]["join"] for r in range(n)}) == 1  # every rank names the same last rank
    return bad


def gradient_records(tmp_path) -> dict:
    ranks = read_ranks(str(tmp_path), GRAD)
    assert sorted(ranks) == list(range(3))
    return {r: info["got"] for r, info in ranks.items()}


@pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))
@pytest.mark.parametrize("num_proc", [3, 2])
def test_every_collective_op_and_dtype_on_the_native_engine(tmp_path, num_proc):
    """On sparktrain's TensorFlow kernels; at 3 ranks, the gradients, tapes and mismatches too."""
    got, engines = run_all(tmp_path, num_proc, {}, gradients="mismatches" if num_proc == 3 else None)
    assert engines == {("native", True)}  # sparktrain's TensorFlow kernels
    assert check_everything(got, num_proc, tmp_path, "native") == []
    check_graph_ranks(read_ranks(str(tmp_path), TAG), num_proc)
    if num_proc == 3:
        grads = gradient_records(tmp_path)
        check_gradients(grads)
        check_mismatches(grads, kernels=True)


@pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))
def test_every_collective_op_and_dtype_on_the_native_engine_through_numpy_function(tmp_path):
    """Without a compiler the ranks fall back to numpy_function (test_tf_kernels.py: with one
    warning; SPARKTRAIN_TF_KERNELS=0 chooses it too); at 3 ranks, whose splits are uneven, with the
    gradients, tapes and mismatches."""
    missing_compiler = {"CXX": "/nonexistent/g++", "SPARKTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    got, engines = run_all(tmp_path, 3, missing_compiler, gradients="mismatches")
    assert engines == {("native", False)}
    assert check_everything(got, 3, tmp_path, "native") == []
    grads = gradient_records(tmp_path)
    check_gradients(grads)
    check_mismatches(grads, kernels=False)


def test_every_collective_op_and_dtype_on_tensorflows_ring(tmp_path):
    """The fallback engine at 3 ranks, whose splits are uneven, with the gradients, tapes and init
    first called inside a function; sparktrain's own code on this path is the same at every size
    (the native engine, the default, runs at 2 and 3 above)."""
    got, engines = run_all(tmp_path, 3, RING, gradients="plain")
    assert engines == {("tensorflow", False)}
    assert check_everything(got, 3, tmp_path, "tensorflow") == []
    check_gradients(gradient_records(tmp_path))


def test_is_homogeneous_reads_every_ranks_host_from_the_rendezvous(monkeypatch):
    import sparktrain.tensorflow as hvd

    for hosts, want in ((["a", "a", "b"], False), (["a", "b", "a", "b"], True), (["a", "b", "c", "c", "a", "b"], True),
                        (["a", "b", "b", "c", "c", "c"], False)):
        workers = [f"{h}:{7000 + i}" for i, h in enumerate(hosts)]
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker",
                                                                                            "index": 0}}))
        assert hvd.is_homogeneous() is want, hosts


def test_autograph_calls_sparktrains_functions_as_they_are():
    # As it calls TensorFlow's and Keras': a tf.function that calls them does not parse and rewrite
    # their source first. A user's own function is still converted.
    import tensorflow as tf
    from tensorflow.python.autograph.impl import conversion

    import sparktrain.keras
    import sparktrain.tensorflow as hvd

    for fn in (hvd.allreduce, hvd.grouped_allreduce, hvd.alltoall, hvd.broadcast_variables,
               hvd.DistributedGradientTape(tf.GradientTape()).gradient, sparktrain.keras.allreduce):
        assert conversion.is_allowlisted(fn), fn

    def users(x):
        return x

    assert not conversion.is_allowlisted(users)


def test_compression_and_horovods_helpers_in_this_process():
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    x = tf.constant([1.5, -2.25], tf.float64)
    compressed, ctx = hvd.Compression.fp16.compress(x)
    assert compressed.dtype == tf.float16 and ctx == tf.float64
    back = hvd.Compression.fp16.decompress(compressed, ctx)
    assert back.dtype == tf.float64 and back.numpy().tolist() == [1.5, -2.25]
    ints, ctx = hvd.Compression.fp16.compress(tf.constant([3], tf.int32))
    assert ints.dtype == tf.int32 and hvd.Compression.fp16.decompress(ints, ctx).dtype == tf.int32
    same, ctx = hvd.Compression.none.compress(x)
    assert same is x and ctx is None and hvd.Compression.none.decompress(same, ctx) is x
    assert [hvd.check_num_rank_power_of_2(k) for k in (1, 2, 3, 4, 6, 8)] == [True, True, False, True, False, True]
    assert hvd.handle_average_backwards_compatibility(None, None) == hvd.Average
    assert hvd.handle_average_backwards_compatibility(hvd.Max, None) == hvd.Max
    with pytest.warns(DeprecationWarning):
        assert hvd.handle_average_backwards_compatibility(None, False) == hvd.Sum
    from sparktrain.tensorflow import scatter

    e = scatter.SplitsError("alltoall splits must be ...")
    assert isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, sparktrain.InvalidArgumentError)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e) == "alltoall splits must be ..."
    with pytest.raises(RuntimeError, match=r"broadcast_global_variables\(0\).*broadcast_variables\(model.variables"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(ValueError, match=r"ProcessSet takes a list of ranks \(ints >= 0\), got \[0, 'x'\]"):
        hvd.ProcessSet([0, "x"])
    with pytest.raises(ValueError, match=r"names a rank twice"):
        hvd.ProcessSet([1, 1])
    unregistered = hvd.ProcessSet([1, 0])
    assert (unregistered.ranks, unregistered.process_set_id, unregistered.size(), unregistered.rank()) == \
        ([0, 1], None, None, None)
    with pytest.raises(AttributeError, match="no_such_name"):
        hvd.no_such_name  # noqa: B018 - the module's lazy lookup still refuses unknown names


def _ragged_layout_cases():
    rng = np.random.default_rng(7)
    for size in (2, 3):
        for n in (0, 1, 5, 7):
            yield size, [rng.standard_normal((n, 3)).astype(np.float32) for _ in range(size)]


def test_gpu_reducescatter_layout_gives_horovods_rows_through_an_even_split():
    """On GPU, reducescatter is NCCL's, which splits rows evenly: the rows are laid out in padded
    blocks first. Here the layout runs for real, and the even reduce-scatter is numpy's."""
    import tensorflow as tf

    from sparktrain.tensorflow import ringops

    for size, inputs in _ragged_layout_cases():
        n = tf.constant(inputs[0].shape[0], tf.int64)
        counts = tf.stack([ringops.row_split(n, size, r)[1] for r in range(size)])
        block = int(tf.maximum(counts[0], 1))
        padded = [ringops.padded_blocks(tf.constant(x), counts, block).numpy() for x in inputs]
        assert all(p.shape == (size * block, 3) for p in padded)
        total = np.sum(padded, axis=0)
        want = np.sum(inputs, axis=0)
        got = []
        for r in range(size):
            start, count = (int(v) for v in ringops.row_split(n, size, r))
            got.append(total[r * block:(r + 1) * block][:count])
            np.testing.assert_array_equal(got[-1], want[start:start + count])
        assert [len(g) for g in got] == [len(a) for a in np.array_split(want, size)], (size, int(n))


def test_gpu_alltoall_layout_delivers_ragged_and_empty_parts_through_an_even_exchange():
    import tensorflow as tf

    from sparktrain.tensorflow import ringops

    rng = np.random.default_rng(11)
    for size in (2, 3):
        splits = rng.integers(0, 4, (size, size))
        splits[0, :] = 0  # rank 0 sends nothing
        inputs = [rng.standard_normal((int(splits[r].sum()), 2)).astype(np.float32) for r in range(size)]
        block = max(int(splits.max()), 1)
        padded = [ringops.padded_blocks(tf.constant(inputs[r]), tf.constant(splits[r], tf.int64), block).numpy()
                  for r in range(size)]
        for me in range(size):
            # An even alltoall: block `me` of every rank's buffer, in rank order.
            recv = np.stack([padded[r][me * block:(me + 1) * block] for r in range(size)])
            mask = tf.sequence_mask(splits[:, me], block).numpy()
            got = recv[mask]
            want = np.concatenate([inputs[r][splits[r, :me].sum():splits[r, :me + 1].sum()] for r in range(size)])
            np.testing.assert_array_equal(got, want)


def test_on_gpu_reducescatter_and_alltoall_are_tensorflows_nccl_ops(monkeypatch):
    """No GPU here: the graph a GPU rank builds is traced, not run."""
    import tensorflow as tf

    from sparktrain.tensorflow import ringops
    from sparktrain.tensorflow.runtime import state

    monkeypatch.setattr(state, "gpu", True)
    monkeypatch.setattr(state, "size", 3)
    monkeypatch.setattr(state, "rank", 1)

    def op_types(fn, *specs):
        return {op.type for op in tf.function(fn).get_concrete_function(*specs).graph.get_operations()}

    spec = tf.TensorSpec([None, 4], tf.float32)
    scatter = op_types(lambda t: ringops.reducescatter(t, "max"), spec)
    assert "CollectiveReduceScatterV2" in scatter and "CollectiveReduceV2" not in scatter
    exchange = op_types(lambda t, s: ringops.alltoall(t, s), spec, tf.TensorSpec([3], tf.int32))
    assert "CollectiveAllToAllV2" in exchange
    monkeypatch.setattr(state, "gpu", False)
    assert "CollectiveReduceScatterV2" not in op_types(lambda t: ringops.reducescatter(t, "max"), spec)
