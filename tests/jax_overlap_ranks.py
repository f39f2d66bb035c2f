"""What the ranks of tests/test_jax_buckets.py run: Keras 3 on JAX with gradient buckets against the
fused reduction in the same process, and what shows that a bucket travels off XLA's thread, in
program order.

The bucket size is swapped with tests/overlap_ranks.py's ``bucket_bytes``; a step is traced (and
its buckets planned) under the size in force when it is first called.
"""
from __future__ import annotations

import os
import time

from helpers import record_rank
from overlap_ranks import FIT_VARIANTS, SMALL, _threads, _touch, _wait_for, bucket_bytes
from overlap_ranks import _fit as fit


def _fit(variant: dict, limit: int) -> str:
    return fit(variant, limit, jit_compile="auto")  # jitted: JAX's default


def fused_against_buckets(outdir: str) -> None:
    """Each variant fused, then each in buckets; the engine's threads after each half."""
    import sparktrain.keras as hvd

    hvd.init()
    fused = {name: _fit(variant, 0) for name, variant in FIT_VARIANTS.items()}
    threads_fused = _threads()
    bucketed = {name: _fit(variant, SMALL) for name, variant in FIT_VARIANTS.items()}
    record_rank(outdir, digests={name: [fused[name], bucketed[name]] for name in FIT_VARIANTS},
                threads_fused=threads_fused, threads=_threads())


def _late(v, m):
    """``v`` unchanged, once a chain of matmuls on ``m`` has run: it exists later than ``v`` does."""
    import jax.numpy as jnp

    h = m
    for _ in range(24):
        h = jnp.tanh(h @ m)
    return v + 0.0 * jnp.sum(h)


def _same(v):
    return v


def _callbacks(v, count: int = 8, last=_same):
    """``v`` through a chain of ``count`` host callbacks (each returns its argument; the last is
    ``last``). Each is a thunk of its own, so the step has more thunks than XLA's CPU runtime runs
    one after the other (8): it runs them as their inputs are ready, the chain's first ones while the
    bucket beside it is handed over."""
    import jax

    for i in range(count):
        v = jax.pure_callback(last if i == count - 1 else _same, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    return v


def engine_thread_and_order(outdir: str) -> None:
    """Three checks on 2 ranks:

    - off the thread: rank 0's first bucket waits for rank 1, which enters it only once rank 0's
      step has run a callback beside it (the last of a chain, so it comes after the bucket was
      handed over); with the bucket on XLA's thread, the callback could not run (rank 1 would give
      up waiting and the record says so);
    - order: rank 0 makes the first bucket's array first, rank 1 makes it last, yet every rank
      reduces the buckets in program order: each bucket's sums are its own;
    - a mismatch: rank 1 reduces an array of another shape, refused on both ranks naming both.
    """
    import jax
    import jax.numpy as jnp

    import sparktrain.keras as hvd
    from sparktrain._jax import collectives as jax_engine

    hvd.init()
    r = hvd.rank()
    marker = os.path.join(outdir, "rank0-went-on")
    went_on_at = []

    def went_on(v):
        went_on_at.append(time.time())
        _touch(marker)
        return v

    a = jnp.full(4096, r + 1.0, jnp.float32)
    b = jnp.full(4096, 10.0 * (r + 1), jnp.float32)
    m = jnp.full((256, 256), 1.0 / 256, jnp.float32)
    with bucket_bytes(1024):
        @jax.jit
        def bucket_then_other(a, b):
            return jax_engine.fused_allreduce([a, b], op="sum"), _callbacks(a, last=went_on if r == 0 else _same)

        saw = _wait_for(marker, 60.0) if r == 1 else None
        started = time.time()
        reduced, _ = bucket_then_other(a, b)
        first = [float(reduced[0][0]), float(reduced[1][0])]
        finished = time.time()

        @jax.jit
        def out_of_order(a, b, m):
            # The buckets go last array first: b's bucket, then a's. Rank 0 makes b first, rank 1 a.
            late_a, late_b = (_late(a, m), b) if r == 0 else (a, _late(b, m))
            return jax_engine.fused_allreduce([late_a, late_b], op="sum"), _callbacks(a)

        ordered = [float(t[0]) for t in out_of_order(a, b, m)[0]]

        mismatch = None
        try:
            other = b if r == 0 else jnp.concatenate([b, b])
            jax.block_until_ready(jax.jit(lambda a, b: jax_engine.fused_allreduce([a, b], op="sum"))(a, other))
        except Exception as e:  # noqa: BLE001 - JAX's runtime error, recorded as it is
            mismatch = f"{type(e).__name__}: {e}"
    record_rank(outdir, first=first, saw_marker=saw, went_on_at=went_on_at, started=started, finished=finished,
                ordered=ordered, mismatch=mismatch, after=jax_engine.average_floats([r + 1.0]),
                threads=_threads())


def dies_in_a_bucket(outdir: str) -> None:
    """Rank 1 dies while rank 0's first bucket waits for it."""
    import jax
    import jax.numpy as jnp

    import sparktrain.keras as hvd
    from sparktrain._jax import collectives as jax_engine

    hvd.init()
    r = hvd.rank()
    marker = os.path.join(outdir, "rank0-in-bucket")

    def in_bucket(v):
        _touch(marker)
        return v

    a = jnp.ones(4096, jnp.float32)
    if r == 1:
        if _wait_for(marker, 60.0):
            os._exit(17)
        return
    with bucket_bytes(1024):
        @jax.jit
        def step(a, b):
            reduced = jax_engine.fused_allreduce([a, b], op="sum")
            # Callbacks beside the bucket, the last run once its reduction is under way.
            return reduced, _callbacks(a, last=in_bucket)

        jax.block_until_ready(step(a, a))
