#!/usr/bin/env python
"""A study of the digits CNN on gangs of 2 ranks: ``sparktrain.tune`` against the loop users write today.

Every contender trains the same trials: ``--trials`` parameter sets (a learning rate and a
number of filters) queued with ``study.enqueue_trial`` in one order, each a Keras 3 CNN on the
8x8 digits for ``--epochs`` epochs with ``DistributedOptimizer`` on 2 ranks, its value the
validation accuracy after the last epoch. The contenders, on one warm ``local[4]`` session:

- ``study.optimize(lambda t: sparktrain.run(...))``: the peer, one gang at a time, no pruning
  (the trial stays on the driver);
- ``sparktrain.tune.optimize`` with ``concurrent_trials=1``, then ``2``, without pruning;
- ``sparktrain.tune.optimize`` with ``concurrent_trials=2`` and a ``MedianPruner`` (Optuna's
  ``KerasPruningCallback`` on the ranks).

For each: the study's wall time and its ratio to the peer's; the median gap from a trial's end
(the driver told the study) to the next trial's rank 0 entering the objective; the fraction of
the cluster's slot-time that held a rank (the ranks' time in the objective, times 2 ranks, over
the wall time times the 4 slots); the best value, and the trials pruned.

    python benchmarks/tune.py [--trials 12] [--epochs 4] [--rounds 3] [--write benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

from common import machine_line, settle, text_table, write_section

SECTION_BEGIN = "<!-- tune:begin -->"
SECTION_END = "<!-- tune:end -->"
SLOTS = 4
NUM_PROC = 2
LRS = [3e-3, 1e-3, 1e-5, 2e-3, 3e-5, 5e-3, 1e-4, 1e-6, 4e-3, 2e-5, 8e-4, 6e-6]


def fit(lr: float, filters: int, epochs: int, trial=None) -> float:
    """The digits CNN on this rank's shard; with ``trial``, Optuna's pruning callback watches it."""
    import keras

    import sparktrain.keras as hvd
    from sparktrain.cli.demo import digits

    hvd.init()
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size())
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr * hvd.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    if trial is not None:
        from optuna_integration import KerasPruningCallback

        callbacks.append(KerasPruningCallback(trial, "val_accuracy"))
    history = model.fit(x.reshape(-1, 8, 8, 1), y, batch_size=32, epochs=epochs, verbose=0,
                        validation_data=(x_test.reshape(-1, 8, 8, 1), y_test), callbacks=callbacks)
    return float(history.history["val_accuracy"][-1])


def objective(epochs: int, trial) -> float:
    """sparktrain.tune's objective: on every rank; rank 0 notes when it entered and left."""
    import sparktrain

    entered = time.time()
    lr = trial.suggest_float("lr", 1e-6, 1e-2, log=True)
    filters = trial.suggest_int("filters", 8, 32, step=8)
    try:
        return fit(lr, filters, epochs, trial)
    finally:
        if sparktrain.rank() == 0:
            trial.set_user_attr("entered", entered)
            trial.set_user_attr("left", time.time())


def timed_fit(lr: float, filters: int, epochs: int) -> tuple[float, float, float]:
    """The peer's train function: the value, and when rank 0 entered and left it."""
    entered = time.time()
    value = fit(lr, filters, epochs)
    return value, entered, time.time()


def study_of(trials: int, pruned: bool):
    import optuna

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1) if pruned else \
        optuna.pruners.NopPruner()
    study = optuna.create_study(direction="maximize", pruner=pruner)
    for i in range(trials):
        study.enqueue_trial({"lr": LRS[i % len(LRS)], "filters": (8, 16, 32)[i % 3]})
    return study


def peer(study, trials: int, epochs: int) -> float:
    """``study.optimize(lambda t: sparktrain.run(...))``, as users write it today; its wall time."""
    import sparktrain

    def run_one(t):
        value, entered, left = sparktrain.run(timed_fit, args=(t.suggest_float("lr", 1e-6, 1e-2, log=True),
                                                                t.suggest_int("filters", 8, 32, step=8), epochs),
                                              num_proc=NUM_PROC, verbose=0, stdout=open(os.devnull, "w"))
        t.set_user_attr("entered", entered)
        t.set_user_attr("left", left)
        return value

    start = time.monotonic()
    study.optimize(run_one, n_trials=trials)
    return time.monotonic() - start


def tuned(study, trials: int, epochs: int, concurrent: int) -> float:
    import sparktrain.tune

    start = time.monotonic()
    sparktrain.tune.optimize(study, functools.partial(objective, epochs), n_trials=trials,
                             concurrent_trials=concurrent, num_proc=NUM_PROC, stdout=open(os.devnull, "w"))
    return time.monotonic() - start


def gaps(study, calls: list[float]) -> list[float]:
    """For each trial that waited for a slot: its rank 0's entry minus the end of the trial before it,
    within one optimize call (``calls``: when each began)."""
    ended = sorted(t.datetime_complete.timestamp() for t in study.trials if t.datetime_complete)
    out = []
    for t in study.trials:
        entered = t.user_attrs.get("entered")
        started = t.datetime_start.timestamp()
        call = max((c for c in calls if c <= started), default=0.0)
        before = [e for e in ended if call <= e <= started + 0.05]
        if entered is not None and before:
            out.append(entered - before[-1])
    return out


def busy(study, wall: float) -> float:
    """The ranks' time in the objective times the ranks, over the wall time times the slots."""
    held = sum(t.user_attrs["left"] - t.user_attrs["entered"] for t in study.trials if "left" in t.user_attrs)
    return held * NUM_PROC / (wall * SLOTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of trials, the contenders' order rotated")
    parser.add_argument("--write", metavar="RESULTS.md")
    a = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                os.environ.get("PYTHONPATH", "")])
    import optuna
    from pyspark.sql import SparkSession

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spark = SparkSession.builder.master(f"local[{SLOTS}]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    contenders = [("study.optimize(lambda t: sparktrain.run(...)) (peer)", False,
                   lambda st, n: peer(st, n, a.epochs)),
                  ("tune.optimize, concurrent_trials=1", False, lambda st, n: tuned(st, n, a.epochs, 1)),
                  ("tune.optimize, concurrent_trials=2", False, lambda st, n: tuned(st, n, a.epochs, 2)),
                  ("tune.optimize, concurrent_trials=2, MedianPruner", True, lambda st, n: tuned(st, n, a.epochs, 2))]
    # Each contender's study runs in rounds of trials, the contenders' order rotated each round: a
    # busy moment of the machine falls on all of them, not on one.
    studies = [study_of(a.trials, pruned) for _, pruned, _ in contenders]
    walls = [0.0] * len(contenders)
    calls: list[list[float]] = [[] for _ in contenders]
    per_round = -(-a.trials // a.rounds)
    for r in range(a.rounds):
        n = min(per_round, a.trials - r * per_round)
        order = list(range(len(contenders)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            settle()
            calls[i].append(time.time())
            walls[i] += contenders[i][2](studies[i], n)
            print(f"round {r + 1}: {contenders[i][0]}: {walls[i]:.1f} s so far", flush=True)
    rows = []
    for (name, _, _), study, wall, began in zip(contenders, studies, walls, calls):
        states = [t.state.name for t in study.trials]
        g = gaps(study, began)
        rows.append([name, f"{wall:.1f}", f"{wall / walls[0]:.2f}x",
                     f"{statistics.median(g):.2f}" if g else "-", f"{busy(study, wall):.2f}",
                     f"{study.best_value:.3f}", str(states.count("PRUNED")), str(states.count("COMPLETE"))])
    header = ["contender", "study wall s", "vs peer", "median gap s (end to next ranks)", "slot-time held",
              "best val_accuracy", "pruned", "complete"]
    print(text_table(header, rows))
    if a.write:
        write_section(
            a.write, SECTION_BEGIN, SECTION_END, "A study of gangs: sparktrain.tune",
            f"{a.trials} trials of the digits CNN ({a.epochs} epochs, Keras 3 on TensorFlow, "
            f"DistributedOptimizer, {NUM_PROC} ranks each), the same queued parameters for every contender, "
            f"on one warm local[{SLOTS}] session, in {a.rounds} rounds of trials with the contenders' order rotated "
            "each round (the wall time is the sum over the rounds). Gap: from the driver telling the study a trial ended to the "
            "next trial's rank 0 entering the objective (the launch of its gang included). Slot-time held: the "
            f"ranks' time in the objective over the study's wall time times {SLOTS} slots.",
            machine_line(["tensorflow", "keras", "optuna"], f"local[{SLOTS}]"),
            f"python benchmarks/tune.py --trials {a.trials} --epochs {a.epochs} --rounds {a.rounds} --write {a.write}",
            header, rows, after_table=[f"Load average (1 min) when it ended: {os.getloadavg()[0]:.2f}."])


if __name__ == "__main__":
    main()
