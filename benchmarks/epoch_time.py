#!/usr/bin/env python
"""Epoch time of sparktrain.keras.DistributedOptimizer on Keras 3 and on tf_keras next to tf_keras under MultiWorkerMirroredStrategy.

Four contenders train the same model on the same data with the same global batch, one after
the other in this invocation, each as one ``sparktrain.run``:

- ``DistributedOptimizer (Keras 3)``: ``--num-proc`` ranks (default 3), Keras 3 with
  ``sparktrain.keras.DistributedOptimizer(Adam)``, ``BroadcastGlobalVariablesCallback(0)`` and
  ``MetricAverageCallback()``; each rank trains on its shard ``x[rank::size]`` with batch
  ``global_batch / size``;
- ``tf_keras strategy``: the same ranks, tf_keras (``TF_USE_LEGACY_KERAS=1``) under
  ``sparktrain.tensorflow.strategy()`` (a MultiWorkerMirroredStrategy); the same shards and
  per-rank batch, fed through ``strategy.distribute_datasets_from_function``;
- ``DistributedOptimizer (tf_keras)``: the same ranks, the same code as the Keras 3 contender on
  tf_keras (``TF_USE_LEGACY_KERAS=1``: Horovod users' Keras 2 code);
- ``one process (Keras 3)``: one rank, Keras 3 with the plain Adam, all the data, the global batch.

The data are scikit-learn's bundled 8x8 digits (``sparktrain.cli.demo.digits``, nothing is
downloaded), tiled ``--repeat-data`` times and cut to a whole number of global batches, so every
contender runs the same steps per epoch on the same samples. Every rank feeds its data through
the same in-memory ``tf.data`` pipeline (slices, batch, repeat, prefetch; no shuffling). The model is
``sparktrain.cli.demo.build_cnn``'s CNN (or an MLP with ``--model mlp``), built layer for layer with
Keras 3 or tf_keras. Every contender compiles with Adam(0.001 x global batch / 32), the loss and the
accuracy metric, without XLA.

A callback inside the ranks takes ``time.perf_counter()`` at ``on_epoch_begin`` and
``on_epoch_end``; rank 0's epoch times come back. The first epoch of each run (tracing, warm-up)
is discarded; the table shows the median of the rest.

    python benchmarks/epoch_time.py [--epochs 6 --repeat-data 10 --rounds 2] [--spark] [--write benchmarks/RESULTS.md]

``--scaling`` measures how CPU training scales instead: one process with 1 thread (once free to
use every core for TensorFlow's inter-op and input threads, once confined to one core, as each
rank is) against 2
ranks with 1 thread each (``OMP_NUM_THREADS`` and TensorFlow's intra-op threads 1, its inter-op
pool 2, as sparktrain's defaults for one CPU per task),
the gradients averaged by the native engine and, separately, by TensorFlow's ring. Twice: with
the same global batch for all (strong scaling: each rank takes half the batch), and with the
same batch per rank (weak scaling, the convention of Horovod's scaling figures: the 2 ranks take
a global batch twice the size, in half the steps per epoch). It reports each one's samples/s and
the ratio to the one process::

    python benchmarks/epoch_time.py --scaling --num-proc 2 --global-batch 64 --write benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time

from common import HostSteal, failed, machine_line, settle, short_reason, text_table, write_section

SECTION_BEGIN = "<!-- epoch_time:begin -->"
SECTION_END = "<!-- epoch_time:end -->"

OURS = "DistributedOptimizer (Keras 3)"
OURS_TF_KERAS = "DistributedOptimizer (tf_keras)"
PEER = "tf_keras strategy"
SINGLE = "one process (Keras 3)"

#: Environment of every rank: TensorFlow's C++ logging off.
BASE_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


# -- what the ranks run (self-contained: cloudpickle ships these functions by value) -------------

def load_data(repeat: int, global_batch: int):
    """The digits training images as (N, 8, 8, 1), tiled ``repeat`` times, cut to whole global batches."""
    import numpy as np

    from sparktrain.cli.demo import digits

    (x, y), _ = digits()
    x = np.tile(x, (repeat, 1))
    y = np.tile(y, repeat)
    n = len(x) // global_batch * global_batch
    return x[:n].reshape(-1, 8, 8, 1), y[:n]


def build_model(k, kind: str):
    """The same layers with Keras 3 (``k`` = keras) or tf_keras (``k`` = tf_keras).

    ``cnn`` is ``sparktrain.cli.demo.build_cnn``'s network.
    """
    if kind == "cnn":
        from sparktrain.cli.demo import build_cnn

        return build_cnn(k)
    layers = [
        k.layers.Flatten(),
        k.layers.Dense(256, activation="relu"),
        k.layers.Dense(128, activation="relu"),
        k.layers.Dense(10, activation="softmax"),
    ]
    return k.Sequential([k.Input((8, 8, 1)), *layers])


def epoch_timer(base):
    """A callback class (subclass of ``base``) that records each epoch's wall time."""

    class EpochTimer(base):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def turn_timer(base, directory: str, index: int, timeout: float, rank: int):
    """An epoch timer (subclass of ``base``) whose every epoch first waits for a byte on this rank's
    turn FIFO, and then reports its wall time on the contender's done FIFO (see ``take_turns``)."""
    import select

    class TurnTimer(base):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0
            # The coordinator holds both FIFOs open read-write, so neither open blocks.
            self._turn = os.open(os.path.join(directory, f"turn-{index}-{rank}"), os.O_RDONLY | os.O_NONBLOCK)
            self._done = os.path.join(directory, f"done-{index}")

        def on_epoch_begin(self, epoch, logs=None):
            ready, _, _ = select.select([self._turn], [], [], timeout)
            if not ready or os.read(self._turn, 1) != b"x":
                raise RuntimeError(f"rank {rank}: no turn for epoch {epoch} within {timeout:.0f} s")
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self._start
            self.seconds.append(seconds)
            fd = os.open(self._done, os.O_WRONLY)
            try:
                os.write(fd, f"{rank} {seconds!r}\n".encode())  # one short write: atomic on a FIFO
            finally:
                os.close(fd)

    return TurnTimer()


def pipeline(tf, x, y, batch: int):
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
            .prefetch(tf.data.AUTOTUNE))


def train_keras3(kind: str, repeat: int, global_batch: int, epochs: int, lr: float, distributed: bool,
                 turns: tuple | None = None) -> dict:
    """The Keras the rank serves (Keras 3, or tf_keras where its env sets ``TF_USE_LEGACY_KERAS=1``):
    with DistributedOptimizer on every rank, or the plain optimizer in one process.

    ``turns`` (``--scaling``): ``(directory, contender index, timeout)``; every epoch then waits for
    its turn (see ``take_turns``) instead of starting at once."""
    import tensorflow as tf

    from sparktrain import kerasline

    keras = kerasline.module()

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = load_data(repeat, global_batch)
    steps = len(x) // global_batch
    x, y = x[r::n], y[r::n]
    model = build_model(keras, kind)
    opt = keras.optimizers.Adam(lr)
    callbacks = []
    if distributed:
        opt = hvd.DistributedOptimizer(opt)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    timer = turn_timer(keras.callbacks.Callback, *turns, r) if turns else epoch_timer(keras.callbacks.Callback)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=False)
    history = model.fit(pipeline(tf, x, y, global_batch // n), steps_per_epoch=steps, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[*callbacks, timer])  # the timer last: its epoch end follows the averaging
    return {"epoch_s": timer.seconds, "steps": steps, "params": int(model.count_params()),
            "loss": float(history.history["loss"][-1]), "ranks": n}


def train_tf_keras_strategy(kind: str, repeat: int, global_batch: int, epochs: int, lr: float) -> dict:
    """tf_keras under MultiWorkerMirroredStrategy, from ``sparktrain.tensorflow.strategy()``."""
    import tensorflow as tf
    import tf_keras

    import sparktrain.tensorflow as hvd

    strategy = hvd.strategy()
    x, y = load_data(repeat, global_batch)
    steps = len(x) // global_batch

    def dataset_fn(ctx):  # each worker reads its own shard, like the Keras 3 ranks do
        i, k = ctx.input_pipeline_id, ctx.num_input_pipelines
        return pipeline(tf, x[i::k], y[i::k], ctx.get_per_replica_batch_size(global_batch))

    data = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = build_model(tf_keras, kind)
        model.compile(optimizer=tf_keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    timer = epoch_timer(tf_keras.callbacks.Callback)
    history = model.fit(data, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[timer])
    return {"epoch_s": timer.seconds, "steps": steps, "params": int(model.count_params()),
            "loss": float(history.history["loss"][-1]), "ranks": strategy.num_replicas_in_sync}


# -- driver side ---------------------------------------------------------------------------------

class Contender:
    def __init__(self, name: str, fn, args: tuple, num_proc: int, env: dict, cores: int | None = None):
        self.name, self.fn, self.args, self.num_proc, self.env = name, fn, args, num_proc, env
        self.cores = cores  # run confined to this many cores (None: the machine's)
        self.epochs: list[float] = []  # timed epochs, first epoch of every run dropped
        self.first: list[float] = []   # the dropped first epochs
        self.info: dict = {}
        self.steal: float | None = None  # --scaling: median share of the machine the host took per epoch
        self.status: str | None = None  # why there are no numbers

    def median(self) -> float | None:
        return statistics.median(self.epochs) if self.status is None and self.epochs else None


def build_contenders(args) -> list[Contender]:
    n, sign = args.num_proc, (1 if args.spark else -1)
    # One learning rate for all: they all take steps of the same global batch.
    common = (args.model, args.repeat_data, args.global_batch, args.epochs, 0.001 * args.global_batch / 32)
    return [
        Contender(OURS, train_keras3, (*common, True), sign * n, BASE_ENV),
        Contender(PEER, train_tf_keras_strategy, common, sign * n, {**BASE_ENV, "TF_USE_LEGACY_KERAS": "1"}),
        Contender(OURS_TF_KERAS, train_keras3, (*common, True), sign * n, {**BASE_ENV, "TF_USE_LEGACY_KERAS": "1"}),
        Contender(SINGLE, train_keras3, (*common, False), sign * 1, BASE_ENV),
    ]


SCALING_BEGIN = "<!-- epoch_scaling:begin -->"
SCALING_END = "<!-- epoch_scaling:end -->"
# One compute thread; TensorFlow's inter-op pool keeps 2, as sparktrain's thread defaults do.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
SCALING_HEADER = ["contender", "ranks x batch", "steps/epoch", "timed epochs", "median epoch s", "samples/s",
                  "x one process on 1 core", "x one process on both", "host steal", "last loss"]
ONE_CORE = "one process, 1 thread, 1 core"
SCALING_TARGET = "2 ranks x 1 thread, native engine, same batch per rank"


def build_scaling(args) -> list[Contender]:
    def common(global_batch):
        return (args.model, args.repeat_data, global_batch, args.epochs, 0.001 * global_batch / 32)

    one, two = common(args.global_batch), common(args.global_batch * 2)
    base = {**BASE_ENV, **ONE_THREAD, **({} if args.pin else {"SPARKTRAIN_PIN_CORES": "off"})}
    native, ring = {**base, "SPARKTRAIN_CPU_COLLECTIVES": "native"}, {**base, "SPARKTRAIN_CPU_COLLECTIVES": "tensorflow"}
    return [
        # The reference: one core, as each pinned rank has.
        Contender(ONE_CORE, train_keras3, (*one, False), -1, base, cores=1),
        Contender("one process, 1 thread, both cores", train_keras3, (*one, False), -1, base),
        # No gradient averaging: what two ranks could reach on this machine if they never waited.
        Contender("2 independent processes x 1 thread, no averaging", train_keras3, (*two, False), -2, base),
        Contender("2 ranks x 1 thread, native engine, same global batch", train_keras3, (*one, True), -2, native),
        Contender("2 ranks x 1 thread, TensorFlow ring, same global batch", train_keras3, (*one, True), -2, ring),
        Contender(SCALING_TARGET, train_keras3, (*two, True), -2, native),
        # Waits that sleep almost at once, as they did before spin_wait (and do where ranks outnumber cores).
        Contender(f"{SCALING_TARGET}, spin_wait 0", train_keras3, (*two, True), -2,
                  {**native, "SPARKTRAIN_SPIN_WAIT": "0"}),
        Contender("2 ranks x 1 thread, TensorFlow ring, same batch per rank", train_keras3, (*two, True), -2, ring),
    ]


class Member:
    """One contender of ``take_turns``: its own ``sparktrain.run``, in a process of its own."""

    def __init__(self, c: Contender, index: int, directory: str, argv: list[str]):
        import subprocess

        self.c, self.index, self.ranks = c, index, abs(c.num_proc)
        self.turns, self.lines = [], b""
        for r in range(self.ranks):  # open read-write: the opens on either side never block
            os.mkfifo(os.path.join(directory, f"turn-{index}-{r}"))
            self.turns.append(os.open(os.path.join(directory, f"turn-{index}-{r}"), os.O_RDWR))
        os.mkfifo(os.path.join(directory, f"done-{index}"))
        self.done = os.open(os.path.join(directory, f"done-{index}"), os.O_RDWR | os.O_NONBLOCK)
        self.result = os.path.join(directory, f"result-{index}.json")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv,
                                      "--member", str(index), "--turns", directory])
        self.steal: list[float] = []  # the host's steal during each timed epoch, fraction of the machine

    def epoch(self, timeout: float) -> float:
        """Give every rank its turn for one epoch; the slowest rank's wall time."""
        import select

        for fd in self.turns:
            os.write(fd, b"x")
        seconds: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(seconds) < self.ranks:
            if self.proc.poll() is not None:
                raise RuntimeError(f"its run ended (exit {self.proc.returncode}) before epoch's end; see above")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no epoch end within {timeout:.0f} s")
            if select.select([self.done], [], [], min(left, 1.0))[0]:
                self.lines += os.read(self.done, 4096)
                *complete, self.lines = self.lines.split(b"\n")
                for line in complete:
                    rank, value = line.split()
                    seconds[int(rank)] = float(value)
        return max(seconds.values())

    def finish(self, timeout: float) -> None:
        import json

        self.proc.wait(timeout)
        if self.c.status is None:
            with open(self.result) as f:
                self.c.info = json.load(f)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (*self.turns, self.done):
            os.close(fd)


def take_turns(contenders: list[Contender], args, argv: list[str]) -> None:
    """Run every contender at once, each in its own process, and let them take turns epoch by
    epoch: one contender trains an epoch while all the others wait, blocked on a FIFO.

    The host under a virtual machine takes CPU time away in bursts that last seconds; timed one
    after another, two contenders meet different hosts. Taking turns, the epochs compared lie
    seconds apart, and each ratio is a median over pairs of neighbouring epochs. Every other round
    goes in reverse order, so that no contender always follows the same one."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="sparktrain-turns-")
    members: list[Member] = []
    try:
        members = [Member(c, i, directory, argv) for i, c in enumerate(contenders)]
        for epoch in range(args.epochs):
            if epoch == 1 and args.settle > 0:
                settle(args.settle)  # every process has started and traced; the machine is quiet again
            for m in members if epoch % 2 == 0 else members[::-1]:
                if m.c.status is not None:
                    continue
                steal = HostSteal()
                try:
                    seconds = m.epoch(args.timeout)
                except Exception as e:  # noqa: BLE001 - one contender failing must not stop the others
                    m.c.status = f"failed: {short_reason(e)}"
                    print(f"--- {m.c.name} failed: {e}", file=sys.stderr, flush=True)
                    continue
                if epoch == 0:
                    m.c.first.append(seconds)
                else:
                    m.c.epochs.append(seconds)
                    m.steal.append(steal.share())
            print(f"epoch {epoch}: " + "  ".join(f"{m.c.epochs[-1] if m.c.epochs else m.c.first[-1]:.3f}"
                                                 for m in members if m.c.status is None), file=sys.stderr, flush=True)
        for m in members:
            try:
                m.finish(args.timeout)
            except Exception as e:  # noqa: BLE001
                m.c.status = m.c.status or f"failed: {short_reason(e)}"
            m.c.steal = statistics.median(m.steal) if m.steal else None
    finally:
        for m in members:
            m.close()
        shutil.rmtree(directory, ignore_errors=True)


def serve_member(args) -> int:
    """``--member I``: run contender I of ``build_scaling`` as ``take_turns`` asks, and write what
    rank 0 returned to ``result-I.json`` in the turns directory."""
    import json

    import sparktrain

    c = build_scaling(args)[args.member]
    if c.cores:  # before anything starts a thread: the ranks inherit it
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:c.cores])
    out = sparktrain.run(c.fn, args=(*c.args, (args.turns, args.member, args.timeout)), num_proc=c.num_proc,
                         env=c.env, verbose=0, output_ranks=[0], stdout=sys.stderr, timeout=args.timeout * args.epochs)
    with open(os.path.join(args.turns, f"result-{args.member}.json"), "w") as f:
        json.dump({k: v for k, v in out.items() if k != "epoch_s"}, f)
    return 0


def paired_ratio(c: Contender, reference: Contender) -> float | None:
    """Median over the timed epochs of c's samples/s over the reference's in the same round."""
    if c.median() is None or reference.median() is None:
        return None
    work = c.info["steps"] * c.args[2]
    ref_work = reference.info["steps"] * reference.args[2]
    pairs = [(work / a) / (ref_work / b) for a, b in zip(c.epochs, reference.epochs)]
    return statistics.median(pairs) if pairs else None


def scaling_rows(contenders: list[Contender]) -> list[list[str]]:
    reference, free = contenders[0], contenders[1]
    rows = []
    for c in contenders:
        med, global_batch = c.median(), c.args[2]
        shape = f"{abs(c.num_proc)} x {global_batch // abs(c.num_proc)}"
        if med is None:
            rows.append([c.name, shape, c.status or "no timed epochs"])
            continue
        steps = c.info["steps"]
        ratio, ratio_free = paired_ratio(c, reference), paired_ratio(c, free)
        rows.append([c.name, shape, str(steps), str(len(c.epochs)), f"{med:.3f}", f"{steps * global_batch / med:,.0f}",
                     f"{ratio:.2f}x" if ratio else "n/a", f"{ratio_free:.2f}x" if ratio_free else "n/a",
                     f"{100 * c.steal:.1f}%" if c.steal is not None else "n/a", f"{c.info['loss']:.4f}"])
    return rows


def scaling_target_line(contenders: list[Contender]) -> str:
    by = {c.name: c for c in contenders}
    ratio = paired_ratio(by[SCALING_TARGET], by[ONE_CORE])
    ceiling = paired_ratio(by["2 independent processes x 1 thread, no averaging"], by[ONE_CORE])
    if ratio is None:
        return "target (2 ranks >= 1.8x one process on one core): not measured"
    text = (f"target: {SCALING_TARGET} / {ONE_CORE} = {ratio:.2f}x >= 1.8x: {'yes' if ratio >= 1.8 else 'NO'}")
    if ceiling:
        text += f"; two processes that never wait for each other reach {ceiling:.2f}x ({ratio / ceiling:.0%} of it)"
    return text


@contextlib.contextmanager
def confined(cores: int | None):
    """Every thread of this process (and so every process it starts) on its first ``cores`` cores."""
    if not cores:
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    tids = [int(t) for t in os.listdir("/proc/self/task")]

    def pin(which):
        for tid in tids:
            try:
                os.sched_setaffinity(tid, which)
            except OSError:  # a thread that ended meanwhile
                pass

    pin(allowed[:cores])
    try:
        yield
    finally:
        pin(allowed)


def run_once(c: Contender, timeout: float | None) -> None:
    import sparktrain

    started = time.perf_counter()
    with confined(c.cores):
        out = sparktrain.run(c.fn, args=c.args, num_proc=c.num_proc, env=c.env, verbose=0, output_ranks=[0],
                             stdout=sys.stderr, timeout=timeout)
    wall = time.perf_counter() - started
    c.first.append(out["epoch_s"][0])
    c.epochs.extend(out["epoch_s"][1:])
    c.info = {k: v for k, v in out.items() if k != "epoch_s"}
    print(f"{c.name:<31} run {wall:6.1f} s, epochs " + " ".join(f"{s:.3f}" for s in out["epoch_s"])
          + f" s, last loss {out['loss']:.4f}", file=sys.stderr, flush=True)


def benchmark(contenders: list[Contender], rounds: int, settle_s: float, timeout: float | None) -> None:
    """``rounds`` times: every contender once, in order. A failing contender is dropped, the rest go on."""
    for _ in range(rounds):
        for c in contenders:
            if c.status is not None:
                continue
            if settle_s > 0:
                settle(settle_s)
            try:
                run_once(c, timeout)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - one contender failing must not stop the others
                c.status = failed(c.name, e)


HEADER = ["contender", "ranks x batch", "steps/epoch", "timed epochs", "median epoch s", "min s", "max s",
          "ratio to tf_keras strategy", "samples/s", "last loss"]


def table_rows(contenders: list[Contender], global_batch: int) -> list[list[str]]:
    peer = next(c for c in contenders if c.name == PEER).median()
    rows = []
    for c in contenders:
        med = c.median()
        shape = f"{abs(c.num_proc)} x {global_batch // abs(c.num_proc)}"
        if med is None:
            rows.append([c.name, shape, c.status or "no timed epochs"])
            continue
        steps = c.info["steps"]
        rows.append([c.name, shape, str(steps), str(len(c.epochs)), f"{med:.3f}", f"{min(c.epochs):.3f}",
                     f"{max(c.epochs):.3f}", f"{med / peer:.2f}x" if peer else "n/a",
                     f"{steps * global_batch / med:,.0f}", f"{c.info['loss']:.4f}"])
    return rows


def target_line(contenders: list[Contender]) -> str:
    by = {c.name: c.median() for c in contenders}
    ours, peer = by[OURS], by[PEER]
    if ours is None or peer is None:
        return f"target ({OURS} faster than {PEER}): not measured"
    ratio = peer / ours
    text = (f"target: {PEER} / {OURS} = {ratio:.2f}x (> 1 means DistributedOptimizer is faster): "
            f"{'yes' if ratio > 1 else 'NO'}")
    if by.get(OURS_TF_KERAS) is not None:
        text += f"; {OURS_TF_KERAS} / {OURS} = {by[OURS_TF_KERAS] / ours:.2f}x the epoch time"
    return text


def model_line(contenders: list[Contender], args) -> str:
    params = sorted({c.info["params"] for c in contenders if c.info})
    samples = next((c.info["steps"] * args.global_batch for c in contenders if c.info), None)
    return (f"model {args.model} ({', '.join(map(str, params)) or '?'} parameters), digits x {args.repeat_data} = "
            f"{f'{samples:,}' if samples is not None else '?'} samples per epoch, global batch {args.global_batch}, "
            f"{args.epochs} epochs per run (first dropped), {args.rounds} round(s)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=6,
                   help="epochs per run, the first of which is dropped (default 6: 5 timed)")
    p.add_argument("--repeat-data", type=int, default=10,
                   help="tile the 1500 digits training images this many times (default 10: 14,976 samples, "
                        "156 steps of 96 per epoch)")
    p.add_argument("--global-batch", type=int, default=96, help="global batch (default 96 = 3 ranks x 32)")
    p.add_argument("--num-proc", type=int, default=3, help="ranks of the distributed contenders (default 3)")
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                   help="cnn: sparktrain.cli.demo.build_cnn's network (default); mlp: 64-256-128-10")
    p.add_argument("--rounds", type=int, default=2,
                   help="run all contenders this many times, in turn, pooling their timed epochs (default 2)")
    p.add_argument("--spark", action="store_true",
                   help="launch through an embedded Spark session (--master) instead of local processes")
    p.add_argument("--master", default="local[3]", help="master of the embedded session with --spark (default local[3])")
    p.add_argument("--settle", type=float, default=15.0, metavar="S",
                   help="before each run, wait at most S seconds for the CPU to go quiet (default 15; 0 skips)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--scaling", action="store_true",
                   help="one process with 1 thread against 2 ranks with 1 thread each, native engine and TensorFlow ring")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="with --scaling, leave the ranks unpinned (SPARKTRAIN_PIN_CORES=off) instead of sparktrain's "
                        "default, which gives each rank cores of its own in local mode")
    p.add_argument("--write", metavar="PATH", help="write or replace the epoch-time section of this markdown file")
    p.add_argument("--member", type=int, help=argparse.SUPPRESS)  # --scaling runs each contender so
    p.add_argument("--turns", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scaling and args.spark:
        p.error("--scaling runs its contenders as local processes that take turns; leave out --spark")
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is dropped")
    if min(args.repeat_data, args.num_proc, args.rounds, args.global_batch) < 1:
        p.error("--repeat-data, --num-proc, --rounds and --global-batch must be at least 1")
    if args.global_batch % args.num_proc:
        p.error(f"--global-batch {args.global_batch} must be a multiple of --num-proc {args.num_proc}")
    if 1500 * args.repeat_data < args.global_batch:
        p.error("--repeat-data is too small for one global batch")
    return args


def member_argv(args) -> list[str]:
    """What a ``--member`` process needs to build the same contenders."""
    return ["--scaling", "--epochs", str(args.epochs), "--repeat-data", str(args.repeat_data), "--global-batch",
            str(args.global_batch), "--num-proc", str(args.num_proc), "--model", args.model, "--timeout",
            str(args.timeout), *([] if args.pin else ["--no-pin"])]


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable] + (sys.argv if argv is None else [sys.argv[0], *argv]))
    # The ranks must run this interpreter, where sparktrain, TensorFlow and tf_keras are installed.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    if args.member is not None:
        return serve_member(args)
    if args.scaling:
        contenders = build_scaling(args)
        take_turns(contenders, args, member_argv(args))
        return write_scaling(args, contenders, command)

    spark = None
    if args.spark:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(args.master).appName("sparktrain-epoch-time")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    contenders = build_contenders(args)
    try:
        benchmark(contenders, args.rounds, args.settle, args.timeout)
    finally:
        if spark is not None:
            spark.stop()

    rows = table_rows(contenders, args.global_batch)
    machine, model, target = machine_line(("sparktrain", "tensorflow", "keras", "tf_keras"), args.master if args.spark else None), model_line(contenders, args), target_line(contenders)
    print()
    print(f"epoch time, {args.num_proc} ranks vs one process, "
          f"{'Spark ' + args.master if args.spark else 'local mode'}")
    print(f"machine: {machine}")
    print(model)
    print()
    print(text_table(HEADER, rows))
    print()
    print(target)
    if args.write:
        write_section(
            args.write, SECTION_BEGIN, SECTION_END, "Epoch time",
            "Median epoch time of the same model, data and global batch, each contender run by `sparktrain.run` "
            "in the same invocation, timed inside the ranks (rank 0's view) with the first epoch of every run "
            "dropped. Written by `benchmarks/epoch_time.py`.",
            machine, command, HEADER, rows, before_command=[model[0].upper() + model[1:] + "."],
            after_table=[target[0].upper() + target[1:]])
    return 0 if all(c.status is None for c in contenders) else 1


def write_scaling(args, contenders: list[Contender], command: str) -> int:
    rows = scaling_rows(contenders)
    machine = machine_line(("sparktrain", "tensorflow", "keras"))
    params = sorted({c.info["params"] for c in contenders if c.info})
    model = (f"Model {args.model} ({', '.join(map(str, params)) or '?'} parameters), digits x {args.repeat_data}, "
             f"global batch {args.global_batch} ({2 * args.global_batch} in the same-batch-per-rank rows), "
             f"{args.epochs} epochs per contender (the first dropped).")
    target = scaling_target_line(contenders)
    print()
    print("CPU scaling: one process with 1 thread against 2 ranks with 1 thread each, taking turns epoch by epoch")
    print(f"machine: {machine}")
    print(model)
    print()
    print(text_table(SCALING_HEADER, rows))
    print()
    print(target)
    if args.write:
        write_section(
            args.write, SCALING_BEGIN, SCALING_END, "CPU scaling: 1 process against 2 ranks, 1 thread each",
            "Samples per second of the same model and data: one process with one thread (confined to one core, "
            "as each pinned rank is, then free to use both cores for TensorFlow's inter-op and input threads); two "
            "processes that train alone side by side, never averaging (what two ranks could reach here if they "
            "never waited for each other); and two ranks with one thread each whose gradients are averaged by "
            "sparktrain's native engine or by TensorFlow's ring, first with the same global batch (each rank "
            "takes half), then with the same batch per rank (the global batch doubles, as in Horovod's scaling "
            "figures). All contenders run at once and take turns epoch by epoch, the others blocked meanwhile; "
            "each ratio is the median over rounds of samples/s against the baseline's epoch in the same round. "
            "An epoch's time is its slowest rank's. Host steal: the median share of the machine's CPU time the "
            "hypervisor gave elsewhere during the contender's epochs (/proc/stat). "
            "Written by `benchmarks/epoch_time.py --scaling`.",
            machine, command, SCALING_HEADER, rows, before_command=[model], after_table=[target[0].upper() + target[1:]])
    return 0 if all(c.status is None for c in contenders) else 1


if __name__ == "__main__":
    sys.exit(main())
