"""What the ranks of tests/test_overlap.py run: gradient buckets against the fused reduction, in the
same process, and what shows that a bucket travels off TensorFlow's thread.

The bucket size is the setting ``SPARKTRAIN_BUCKET_BYTES``, which a rank reads once; :func:`bucket_bytes`
swaps the rank's parsed settings for a copy with another size, so that one run trains the same model
fused (0) and in buckets and compares the bits. Functions are traced under the size in force then.
"""
from __future__ import annotations

import contextlib
import os
import time

from helpers import record_rank, weights_digest

#: Small enough that the models here make several buckets.
SMALL = 16 << 10


@contextlib.contextmanager
def bucket_bytes(n: int):
    import dataclasses

    from sparktrain.settings import rank as rank_settings

    before = rank_settings._loaded
    rank_settings._loaded = dataclasses.replace(rank_settings.current(), bucket_bytes=n)
    try:
        yield
    finally:
        rank_settings._loaded = before


def _data(rank: int):
    import numpy as np

    rng = np.random.default_rng(100 + rank)
    x = rng.normal(size=(256, 24)).astype("float32")
    return x, (x[:, :3].sum(1) > 0).astype("int32")


def _mlp(width: int = 64):
    import keras

    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((24,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(2)])


#: The Keras 3 DistributedOptimizer's options each compared fused against bucketed.
FIT_VARIANTS = {
    "plain": {},
    "fp16_predivide": {"compression": "fp16", "gradient_predivide_factor": 2.0},
    "sum_two_passes": {"op": "Sum", "backward_passes_per_step": 2},
}


def _fit(variant: dict, limit: int, jit_compile=False) -> str:
    """A fit of ``_mlp`` through ``DistributedOptimizer`` with ``variant``'s options under the bucket
    size ``limit``; the weights' digest. ``jit_compile``: Keras' own ("auto" on JAX: jitted)."""
    import keras

    import sparktrain.keras as hvd

    options = dict(variant)
    if options.pop("compression", None) == "fp16":
        options["compression"] = hvd.Compression.fp16
    if "op" in options:
        options["op"] = getattr(hvd, options["op"])
    x, y = _data(hvd.rank())
    with bucket_bytes(limit):
        model = _mlp()
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), **options)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return weights_digest(model.get_weights())


def _tape(limit: int) -> str:
    import keras
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    x, y = _data(hvd.rank())
    with bucket_bytes(limit):
        model = _mlp()
        opt = keras.optimizers.SGD(0.05)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(jit_compile=False)
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        for i in range(0, 256, 32):
            step(x[i:i + 32], y[i:i + 32])
    return weights_digest(model.get_weights())


def _threads() -> list[str]:
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:  # the thread ended
            pass
    return sorted(n for n in names if n.startswith("sparktrain-"))


def fused_against_buckets(outdir: str) -> None:
    """Each path fused and in buckets; a timeline of one bucketed fit."""
    import sparktrain.tensorflow as hvd

    hvd.init()
    got = {}
    for name, variant in FIT_VARIANTS.items():
        got[f"fit {name}"] = [_fit(variant, 0), _fit(variant, SMALL)]
    got["tape"] = [_tape(0), _tape(SMALL)]
    path = os.path.join(outdir, "trace.json")
    hvd.start_timeline(path)
    _fit({}, SMALL)
    hvd.stop_timeline()
    record_rank(outdir, digests=got, threads=_threads(), kernels=hvd.collective_engine())


def _wait_for(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write("x")
    os.replace(path + ".tmp", path)


def engine_thread_and_order(outdir: str) -> None:
    """Three checks on 2 ranks, whose TensorFlow has one inter-op thread (``TF_NUM_INTEROP_THREADS=1``):

    - off the thread: rank 0's bucket waits for rank 1, which enters it only once rank 0 has run an
      op that does not depend on the bucket; with the bucket on TensorFlow's only thread, that op
      could not run (rank 1 would give up waiting and the record says so);
    - order: on rank 1 the first bucket's gradient is made only after the second's, yet every rank
      reduces the buckets in program order: each bucket's sums are its own;
    - a mismatch: rank 1 reduces tensors of another shape, refused on both ranks naming both.
    """
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.tensorflow.gradients import allreduce_gradients

    hvd.init()
    r = hvd.rank()
    marker = os.path.join(outdir, "rank0-went-on")

    went_on_at = []

    def went_on(a):
        went_on_at.append(time.time() * 1e6)
        _touch(marker)
        return a

    a = tf.constant(np.full(4096, r + 1.0, np.float32))
    b = tf.constant(np.full(4096, 10.0 * (r + 1), np.float32))
    with bucket_bytes(1024):
        @tf.function(jit_compile=False)
        def bucket_then_other(a, b):
            reduced = allreduce_gradients([a, b], op=hvd.Sum)
            later = tf.reshape(a, [64, 64])  # ops first: the bucket is handed over before the op beside it runs
            for _ in range(8):
                later = tf.matmul(later, later) * 1e-3
            other = tf.numpy_function(went_on, [later], tf.float32, stateful=False) if r == 0 else a
            return reduced, other

        saw = _wait_for(marker, 60.0) if r == 1 else None
        hvd.start_timeline(os.path.join(outdir, "engine-thread.json"))
        reduced, _ = bucket_then_other(a, b)
        hvd.stop_timeline()

    made = []

    def second(x):
        made.append("a")
        return x

    def first(x, *after):
        made.append("b")
        return x

    with bucket_bytes(1024):
        @tf.function(jit_compile=False)
        def out_of_order(a, b):
            # The buckets go last variable first: b's bucket, then a's. On rank 1, b's gradient is
            # made from a's, so only after it.
            a_ = tf.numpy_function(second, [a], tf.float32, stateful=False)
            b_ = tf.numpy_function(first, [b, a_] if r == 1 else [b], tf.float32, stateful=False)
            return allreduce_gradients([tf.reshape(a_, [4096]), tf.reshape(b_, [4096])], op=hvd.Sum)

        ordered = [float(t.numpy()[0]) for t in out_of_order(a, b)]

    mismatch = None
    try:
        with bucket_bytes(1024):
            @tf.function(jit_compile=False)
            def other_shapes(a, b):
                return allreduce_gradients([a, b], op=hvd.Sum)

            other_shapes(a, b if r == 0 else tf.concat([b, b], 0))
    except tf.errors.OpError as e:
        mismatch = f"{type(e).__name__}: {e.message}"
    record_rank(outdir, first=[float(t.numpy()[0]) for t in reduced], saw_marker=saw, went_on_at=went_on_at,
                ordered=ordered, made=made,
                mismatch=mismatch, after=float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()))


def dies_in_a_bucket(outdir: str) -> None:
    """Rank 1 dies while rank 0's first bucket waits for it."""
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.tensorflow.gradients import allreduce_gradients

    hvd.init()
    r = hvd.rank()
    marker = os.path.join(outdir, "rank0-in-bucket")

    def die_once_rank0_waits(x):
        if _wait_for(marker, 60.0):
            os._exit(17)
        return x

    def in_bucket(x):
        _touch(marker)
        return x

    a = tf.constant(np.ones(4096, np.float32))
    with bucket_bytes(1024):
        @tf.function(jit_compile=False)
        def step(a, b):
            if r == 1:
                b = tf.reshape(tf.numpy_function(die_once_rank0_waits, [b], tf.float32, stateful=False), [4096])
            reduced = allreduce_gradients([a, b], op=hvd.Sum)
            # Rank 0: an op beside the bucket, run once its reduction is under way.
            other = tf.numpy_function(in_bucket, [a], tf.float32, stateful=False) if r == 0 else a
            return reduced, other

        step(a, a)
