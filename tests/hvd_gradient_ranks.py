"""Gradients through ``sparktrain.tensorflow``'s collectives against their analytic values, the
gradient tapes' options, ``init`` first called inside a ``tf.function``, and ranks that disagree
on a collective (native engine: an error on every rank, then the next collective works).

:func:`gradient_ranks` runs first in the ranks of test_hvd_collectives' 3-rank runs (it calls
``init`` itself, inside a function) and records what it saw under the tag ``-grad``;
:func:`check_gradients` and :func:`check_mismatches` check the records.
"""
from __future__ import annotations

import re

import numpy as np

from helpers import record_rank

#: The tag of the records, and the number of ranks the checks expect.
GRAD = "-grad"
N = 3
MISMATCHES = ("shape", "dtype", "op", "gather_dims", "root", "in_function", "in_function_dtype", "in_function_op",
              "in_function_gather", "in_function_grouped", "in_function_scatter", "in_function_alltoall")


def gradient_ranks(outdir, mismatches):
    """Recorded under the tag ``-grad``; must run before anything else calls ``init``."""
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    @tf.function
    def first_call():  # init first called while tracing a function
        hvd.init()
        return hvd.allreduce(tf.constant(1.0), op=hvd.Sum)

    got = {"first_call": float(first_call())}
    r, n = hvd.rank(), hvd.size()
    got["then_eager"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum).numpy().tolist()
    w = float(r + 1)  # each rank weighs its output differently, so the gradients carry every rank's

    def grad_of(fn, x):
        x = tf.Variable(x)
        with tf.GradientTape() as tape:
            y = fn(x)
        return tape.gradient(y, x).numpy().tolist()

    ones = tf.ones([2], tf.float32)
    got["allreduce_sum"] = grad_of(lambda x: tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * w), ones)
    got["allreduce_avg"] = grad_of(lambda x: tf.reduce_sum(hvd.allreduce(x) * w), ones)
    got["allreduce_max"] = grad_of(lambda x: tf.reduce_sum(hvd.allreduce(x, op=hvd.Max) * w), ones)
    got["allreduce_scaled"] = grad_of(lambda x: tf.reduce_sum(
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25) * w), ones)
    rows = tf.range(1, 1 + sum(range(1, n + 1)), dtype=tf.float32)[:, None]  # gathered row i weighs (i+1)
    got["allgather"] = grad_of(lambda x: tf.reduce_sum(hvd.allgather(x) * rows * w), tf.ones([r + 1, 2]))
    got["broadcast"] = grad_of(lambda x: tf.reduce_sum(hvd.broadcast(x, root_rank=1) * w), ones)
    got["reducescatter_sum"] = grad_of(lambda x: tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum) * w),
                                       tf.ones([5, 2]))
    got["reducescatter_avg"] = grad_of(lambda x: tf.reduce_sum(hvd.reducescatter(x) * w), tf.ones([5, 2]))
    got["alltoall"] = grad_of(lambda x: tf.reduce_sum(hvd.alltoall(x, splits=list(range(1, n + 1)))[0] * w),
                              tf.ones([sum(range(1, n + 1)), 2]))

    def grouped(x):
        a, b = hvd.grouped_allreduce([x, tf.cast(x, tf.float64)], op=hvd.Sum)
        return tf.reduce_sum(a * w) + tf.cast(tf.reduce_sum(b * 2 * w), tf.float32)
    got["grouped"] = grad_of(grouped, ones)

    @tf.function
    def in_graph(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * w) + tf.reduce_sum(hvd.allgather(x) * w)
        return tape.gradient(y, x)
    got["graph"] = in_graph(ones).numpy().tolist()

    # The tapes: options as Horovod's.
    v = tf.Variable([1.0, 2.0])
    e = tf.Variable(tf.ones([4, 2]))

    def tape_grads(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v) * w + tf.reduce_sum(tf.gather(e, [r, 3]))
        return hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, [v, e])

    dv, de = tape_grads()
    got["tape_avg"] = [dv.numpy().tolist(), type(de).__name__, de.values.numpy().tolist(), de.indices.numpy().tolist()]
    dv, de = tape_grads(op=hvd.Sum, sparse_as_dense=True)
    got["tape_sum_dense"] = [dv.numpy().tolist(), type(de).__name__, de.numpy().tolist()]
    dv, de = tape_grads(gradient_predivide_factor=2.0, compression=hvd.Compression.fp16, groups=2, sparse_as_dense=True)
    got["tape_predivide"] = [dv.numpy().tolist(), tf.convert_to_tensor(de).numpy().tolist()]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v) * w
    got["tape_groups_list"] = hvd.DistributedGradientTape(tape, groups=[[v]]).gradient(loss, [v])[0].numpy().tolist()
    import keras

    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    layer.build((None, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[1.0, 2.0]]))) * w + tf.reduce_sum(v) * w
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer])
    dk, dv = tape.gradient(loss, [layer.kernel, v])
    got["partial"] = [tf.convert_to_tensor(dk).numpy().ravel().tolist(), dv.numpy().tolist()]
    # horovod.tensorflow's DistributedOptimizer, for a Keras optimizer: the gradients averaged.
    u = keras.Variable([0.0, 0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    opt.apply([tf.constant([w, 2 * w])], [u])
    got["optimizer"] = [u.numpy().tolist(), type(opt).__name__]
    try:
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    except ValueError as err:
        got["bad_optimizer"] = str(err)
    try:
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    except ValueError as err:
        got["bad_predivide"] = str(err)

    if mismatches:
        cases = {"shape": lambda: hvd.allreduce(tf.zeros([r + 1])),
                 "dtype": lambda: hvd.allreduce(tf.zeros([2], tf.float32 if r == 0 else tf.float64)),
                 "op": lambda: hvd.allreduce(tf.zeros([2]), op=hvd.Sum if r == 0 else hvd.Max),
                 "gather_dims": lambda: hvd.allgather(tf.zeros([1, 2 + (r == 2)])),
                 "root": lambda: hvd.broadcast(tf.zeros([2]), root_rank=r),
                 "in_function": tf.function(lambda: hvd.allreduce(tf.zeros([r + 1]))),
                 "in_function_dtype": tf.function(lambda: hvd.allreduce(tf.zeros([2], tf.float32 if r == 0
                                                                              else tf.float64))),
                 "in_function_op": tf.function(lambda: hvd.allreduce(tf.zeros([2]), op=hvd.Sum if r == 0
                                                                     else hvd.Max)),
                 "in_function_gather": tf.function(lambda: hvd.allgather(tf.zeros([1, 2 + (r == 2)]))),
                 "in_function_grouped": tf.function(lambda: hvd.grouped_allreduce([tf.zeros([2]),
                                                                                   tf.zeros([r + 1])])),
                 "in_function_scatter": tf.function(lambda: hvd.reducescatter(tf.zeros([3, r + 1]))),
                 "in_function_alltoall": tf.function(lambda: hvd.alltoall(tf.zeros([N, 1 + (r == 2)])))}
        for case, fn in cases.items():
            try:
                fn()
                got[f"mismatch/{case}"] = "no error"
            except tf.errors.OpError as err:
                got[f"mismatch/{case}"] = f"{type(err).__name__}: {err}"
            got[f"after/{case}"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
        got["kernels"] = hvd.collective_kernels()
    record_rank(outdir, GRAD, got=got)


def check_gradients(got):
    n, total = N, sum(range(1, N + 1))  # total: the sum of every rank's weight (r+1)
    offsets = np.cumsum([0] + [k + 1 for k in range(n)])
    for r in range(n):
        g = got[r]
        assert g["first_call"] == n and g["then_eager"] == [float(sum(range(n)))]
        assert g["allreduce_sum"] == [total] * 2  # Sum's gradient: the sum of every rank's
        assert g["allreduce_avg"] == [total / n] * 2
        assert g["allreduce_max"] == [float(n)] * 2  # Horovod: the same op (Max) on the gradient
        assert g["allreduce_scaled"] == [0.25 * total * 2.0] * 2
        # Row i of the gather weighs (i+1) times each rank's weight; the gradient is the Average.
        mine = [[(offsets[r] + j + 1) * total / n] * 2 for j in range(r + 1)]
        assert np.allclose(g["allgather"], mine), (r, g["allgather"])
        assert g["broadcast"] == ([total / n] * 2 if r == 1 else [0.0] * 2)
        split = [5 // n + (1 if k < 5 % n else 0) for k in range(n)]
        owner = np.repeat(np.arange(n), split)  # which rank keeps each row
        assert g["reducescatter_sum"] == [[float((k + 1) * n)] * 2 for k in owner]
        assert g["reducescatter_avg"] == [[float(k + 1)] * 2 for k in owner]
        sent_to = np.repeat(np.arange(n), np.arange(1, n + 1))  # rows for rank k: k+1 of them
        assert g["alltoall"] == [[float(k + 1)] * 2 for k in sent_to]
        assert g["grouped"] == [3.0 * total] * 2
        assert g["graph"] == [total + total / n] * 2  # Sum, plus the Average of the gather's
        # Tapes: dv = 2 v w averaged; e's gradient is sparse (rows r and 3 of every rank).
        dv, kind, values, indices = g["tape_avg"]
        assert np.allclose(dv, [2 * total / n, 4 * total / n]) and kind == "IndexedSlices"
        assert indices == [i for k in range(n) for i in (k, 3)] and np.allclose(values, [[1 / n] * 2] * (2 * n))
        dv, kind, dense = g["tape_sum_dense"]
        assert np.allclose(dv, [2 * total, 4 * total]) and kind != "IndexedSlices"
        assert np.allclose(dense, [[1.0] * 2] * n + [[float(n)] * 2])
        dv, dense = g["tape_predivide"]
        assert np.allclose(dv, [2 * total / n, 4 * total / n], rtol=1e-3)
        assert np.allclose(dense, [[1 / n] * 2] * n + [[1.0] * 2], rtol=1e-3)
        assert np.allclose(g["tape_groups_list"], [2 * total / n, 4 * total / n])
        dk, dv = g["partial"]
        assert np.allclose(dk, [(r + 1) / n, 2 * (r + 1) / n])  # local: not reduced, divided by the size
        assert np.allclose(dv, [total / n] * 2)
        assert "gradient_predivide_factor=2.0" in g["bad_predivide"] and "Average" in g["bad_predivide"]
        assert g["optimizer"] == [[-total, -2.0 * total], "SGD"]  # one SGD step on the summed gradient
        assert "GradientDescentOptimizer" in g["bad_optimizer"] and "Keras optimizer" in g["bad_optimizer"]


def check_mismatches(got, kernels: bool) -> None:
    """Ranks that disagree on a collective (native engine): an error on every rank naming who
    passed what, then the next collective works."""
    for r in range(N):
        assert got[r]["kernels"] is kernels
        for case in MISMATCHES:
            message = got[r][f"mismatch/{case}"]
            # Inside a function TensorFlow reports what a numpy_function raised as an UnknownError;
            # the kernels raise TensorFlow's own error there too.
            in_function = case.startswith("in_function")
            kind = "UnknownError: " if in_function and not kernels else "FailedPreconditionError: "
            assert message.startswith(kind) and "FailedPreconditionError" in message, (case, message)
            assert re.search(r"rank \d passed .* but rank \d passed", message), (case, message)  # who, and what
            assert got[r][f"after/{case}"] == [float(N)], case  # the next collective works
    assert "float64" in got[0]["mismatch/dtype"] and "float32" in got[0]["mismatch/dtype"]
