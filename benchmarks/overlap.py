#!/usr/bin/env python
"""Communication behind backprop: a compiled step whose gradients reduce in buckets, against the
same step's compute alone and the same bytes' allreduce alone.

Each configuration brings up simulated hosts (``tests/simhosts.py``: a network namespace, a
hostname, a private ``/dev/shm`` and a core each, on one bridge; needs root), one rank per host,
each a plain process holding the env contract of a rank of ``sparktrain.run`` (``TF_CONFIG``,
``SPARKTRAIN_RANK``, the collective key), and measures in one go, in the same processes, the
median of ``--steps`` steps of each of:

- compute: the step of an MLP (``--width`` x ``--depth``, float32; a Keras 3 model and optimizer in
  one ``tf.function``) with no reduction: every rank at once, each its own compute;
- allreduce: one fused reduction of tensors of the gradients' shapes, alone;
- fused: the step through ``DistributedGradientTape`` with ``SPARKTRAIN_BUCKET_BYTES=0`` (one
  reduction once every gradient exists);
- buckets: the same with each ``--buckets`` size (the gradients reduced in buckets on the engine's
  thread while backprop goes on).

"step / max" is a step over max(compute, allreduce), the most that overlap can hide; "step /
sum" over their sum, what a step that hides nothing costs. Scaling efficiency is the samples/s of
all hosts over the hosts times one host's alone (its compute): compute / step.

    sudo .venv/bin/python benchmarks/overlap.py [--hosts 2,4] [--shape none,1gbit] [--write benchmarks/RESULTS.md]
    .venv/bin/python benchmarks/overlap.py --local 2     # ranks on this machine, shared memory
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from common import machine_line, text_table, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SECTION_BEGIN = "<!-- overlap:begin -->"
SECTION_END = "<!-- overlap:end -->"
PORT = 29650


def rank_env(rank: int, hosts: list[str], key_file: str, run: str) -> dict:
    """The env contract of rank ``rank`` of a run on ``hosts`` (one rank per entry, host by host)."""
    n = len(hosts)
    local = [i for i, h in enumerate(hosts) if h == hosts[rank]]
    distinct = list(dict.fromkeys(hosts))
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": [f"{h}:{PORT + i}" for i, h in enumerate(hosts)]},
                                     "task": {"type": "worker", "index": rank}}),
            "SPARKTRAIN_RANK": str(rank), "SPARKTRAIN_SIZE": str(n), "SPARKTRAIN_LOCAL_RANK": str(local.index(rank)),
            "SPARKTRAIN_LOCAL_SIZE": str(len(local)), "SPARKTRAIN_CROSS_RANK": str(distinct.index(hosts[rank])),
            "SPARKTRAIN_CROSS_SIZE": str(len(distinct)), "SPARKTRAIN_COLLECTIVE_KEY_FILE": key_file,
            "SPARKTRAIN_RUN_ID": run, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


def measure(args) -> dict:
    """In one rank: every figure, the same collectives in the same order on every rank."""
    import dataclasses

    from sparktrain.host import cpus

    # The thread counts a rank of sparktrain.run gets for the cores it has (this host's).
    os.environ.update(cpus.thread_defaults(len(os.sched_getaffinity(0)), os.environ))
    import keras
    import numpy as np
    import tensorflow as tf

    import sparktrain.tensorflow as hvd
    from sparktrain.settings import rank as rank_settings

    hvd.init()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((args.width,))] +
                             [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)] +
                             [keras.layers.Dense(16)])
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    opt = keras.optimizers.SGD(1e-6)
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.normal(size=(args.batch, args.width)).astype("float32"))
    y = tf.constant(rng.normal(size=(args.batch, 16)).astype("float32"))
    opt.build(model.trainable_variables)

    def step_fn(reduce: bool, bucket_bytes: int = 0):
        rank_settings._loaded = dataclasses.replace(rank_settings.current(), bucket_bytes=bucket_bytes)

        @tf.function(jit_compile=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            if reduce:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        step.get_concrete_function(x, y)  # traced now, under this bucket size
        return lambda: step(x, y).numpy()

    zeros = [tf.zeros_like(v) for v in model.trainable_variables]

    @tf.function(jit_compile=False)
    def allreduce_alone():
        return hvd.grouped_allreduce(zeros, op=hvd.Sum)

    def timed(call) -> float:
        hvd.allreduce(tf.constant(0.0), name="bench.barrier").numpy()
        for _ in range(args.warmup):
            call()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    modes = {"compute": step_fn(False), "allreduce": lambda: [t.numpy() for t in allreduce_alone()],
             "fused": step_fn(True, 0)}
    modes.update({f"buckets {b >> 20} MiB": step_fn(True, b) for b in args.bucket_bytes})
    out: dict = {"params": params, "bytes": params * 4}
    for _ in range(args.rounds):  # rounds of every mode, so that a load that comes and goes hits each
        for name, call in modes.items():
            got = timed(call)
            out[name] = min(out.get(name, got), got)
    hvd.shutdown()
    return out


def run_ranks(hosts: list[str], popen, args) -> dict:
    """Start one rank per entry of ``hosts`` with ``popen(i, argv, env)``; rank 0's figures."""
    run = secrets.token_hex(4)
    with tempfile.TemporaryDirectory(prefix="sparktrain-overlap-") as tmp:
        key = os.path.join(tmp, "key")
        with open(key, "wb") as f:
            f.write(secrets.token_bytes(32))
        me = [sys.executable, os.path.abspath(__file__), "--rank-of", json.dumps(vars(args))]
        procs = [popen(i, me, dict(os.environ, **rank_env(i, hosts, key, run), PYTHONDONTWRITEBYTECODE=""))
                 for i in range(len(hosts))]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            outs.append((p.returncode, out, err))
        for rc, out, err in outs:
            if rc != 0:
                raise RuntimeError(f"a rank failed ({rc}): {err.strip().splitlines()[-3:]}")
        return json.loads([line for line in outs[0][1].splitlines() if line.startswith("{")][-1])


def _row(label: str, f: dict, bucket_names: list[str]) -> list[list[str]]:
    a, b = f["compute"], f["allreduce"]
    rows = []
    for name in ["fused"] + bucket_names:
        s = f[name]
        rows.append([label, name, f"{a * 1e3:.0f}", f"{b * 1e3:.0f}", f"{s * 1e3:.0f}", f"{s / max(a, b):.2f}x",
                     f"{s / (a + b):.2f}x", f"{a / s:.2f}"])
    return rows


HEADER = ["hosts, link", "path", "compute ms", "allreduce ms", "step ms", "step / max", "step / sum",
          "scaling efficiency"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--shape", default="none,1gbit")
    p.add_argument("--local", type=int, default=0, help="N ranks on this machine instead of simulated hosts")
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--buckets", default="1,4,16", help="bucket sizes in MiB")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write", default=None)
    p.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of:
        ns = argparse.Namespace(**json.loads(args.rank_of))
        ns.bucket_bytes = [int(float(m) * (1 << 20)) for m in ns.buckets.split(",")]
        print(json.dumps(measure(ns)), flush=True)
        return 0
    bucket_names = [f"buckets {int(float(m) * (1 << 20)) >> 20} MiB" for m in args.buckets.split(",")]
    rows, figures = [], []
    if args.local:
        def popen(i, argv, env):
            return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        f = run_ranks(["127.0.0.1"] * args.local, popen, args)
        figures.append(f)
        rows += _row(f"{args.local} ranks, one host", f, bucket_names)
    else:
        import simhosts

        reason = simhosts.why_not()
        if reason:
            print(f"cannot simulate hosts here: {reason}", file=sys.stderr)
            return 2
        for h in [int(v) for v in args.hosts.split(",")]:
            sim = simhosts.SimHosts(h).up()
            try:
                for shape in args.shape.split(","):
                    sim.shape_all(shape)

                    def popen(i, argv, env, sim=sim):
                        return sim.popen(i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

                    f = run_ranks(sim.ips, popen, args)
                    figures.append(f)
                    rows += _row(f"{h}, {'unshaped' if shape == 'none' else shape}", f, bucket_names)
                    print(text_table(HEADER, rows[-1 - len(bucket_names):]), flush=True)
            finally:
                sim.down()
    print(text_table(HEADER, rows))
    if args.write:
        f = figures[0]
        command = "sudo .venv/bin/python benchmarks/overlap.py " + " ".join(a for a in sys.argv[1:])
        write_section(args.write, SECTION_BEGIN, SECTION_END, "Communication behind backprop",
                      f"A compiled step of an MLP of {f['params'] / 1e6:.1f} M parameters ({f['bytes'] / 2**20:.0f} MiB "
                      f"of float32 gradients; {args.depth} hidden layers of {args.width}, batch {args.batch} per rank), "
                      "one rank per simulated host: the medians of its compute alone, of the same bytes' allreduce "
                      "alone, of the fused step and of the bucketed steps, all measured in the same processes.",
                      machine_line(["tensorflow", "keras"]), command, HEADER, rows,
                      after_table=["step / max: a step over max(compute, allreduce), at 1.00x when the "
                                   "communication is wholly hidden; step / sum: over their sum, at 1.00x when "
                                   "nothing is. Scaling efficiency: compute / step."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
