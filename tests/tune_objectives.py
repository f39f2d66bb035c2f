"""Objectives of the tune tests, imported by reference on the ranks (tests/ is on their path), and
``python tune_objectives.py``: a driver of its own for the tests that kill or interrupt one.

Each rank writes what it saw to ``<outdir>/t<number>-r<rank>.json``, so a test can read every
rank's view of every trial.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time


def _record(outdir: str, trial, **what) -> None:
    import sparktrain

    info = {"number": trial.number, "rank": sparktrain.rank(), "pid": os.getpid(), **what}
    path = os.path.join(outdir, f"t{trial.number}-r{info['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def read(outdir: str) -> dict[tuple[int, int], dict]:
    """Every rank's record, by (trial number, rank)."""
    out = {}
    for path in glob.glob(os.path.join(outdir, "t*-r*.json")):
        with open(path) as f:
            info = json.load(f)
        out[info["number"], info["rank"]] = info
    return out


def _wait(predicate, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def meeting(outdir: str, trial) -> float:
    """Suggests, then waits until two trials have started (so that trials must overlap to end),
    records what it saw, and returns a value of its suggestions."""
    import sparktrain

    started = time.time()
    x = trial.suggest_float("x", -5.0, 5.0)
    again = trial.suggest_float("x", -5.0, 5.0)
    kind = trial.suggest_categorical("kind", ["a", "b", "c"])
    layers = trial.suggest_int("layers", 1, 4)
    open(os.path.join(outdir, f"started-{trial.number}-{sparktrain.rank()}"), "w").close()
    _wait(lambda: len({p.rsplit("-", 2)[-2] for p in glob.glob(os.path.join(outdir, "started-*"))}) >= 2,
          "a second trial starting beside this one")
    trial.set_user_attr(f"seen_by_rank_{sparktrain.rank()}", x)
    _record(outdir, trial, x=x, again=again, kind=kind, layers=layers, params=trial.params,
            started=started, ended=time.time(), attrs=trial.user_attrs)
    return (x - 1.0) ** 2 + layers


def steps(outdir: str, trial) -> float:
    """Eight steps of a value set by ``x``; reports each (rank 1 reports a value the study must not
    record), asks whether to prune, and records the last step it reached on each rank."""
    import optuna

    import sparktrain

    x = trial.suggest_float("x", -5.0, 5.0)
    fail = trial.suggest_categorical("fail", [False, True])
    if fail and sparktrain.rank() == 1:
        raise ValueError(f"rank 1 of trial {trial.number} fails on purpose")
    value = 0.0
    for step in range(8):
        value = x * x + 1.0 / (step + 1)
        trial.report(value + 1000.0 * sparktrain.rank(), step)
        _record(outdir, trial, last_step=step)
        if trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step}")
    return value


def blocked(outdir: str, trial) -> float:
    """Records its pid, then waits for ``<outdir>/release`` (a driver killed meanwhile leaves it waiting)."""
    x = trial.suggest_float("x", -5.0, 5.0)
    _record(outdir, trial, x=x)
    _wait(lambda: os.path.exists(os.path.join(outdir, "release")), "the release file", timeout=240.0)
    return x * x


def _drive(storage_url: str, outdir: str, n_trials: int) -> None:
    """A driver of its own: local[4], a study in ``storage_url`` with a heartbeat, ``blocked`` trials."""
    import functools

    os.environ["PYSPARK_PYTHON"] = sys.executable
    import optuna
    from pyspark.sql import SparkSession

    import sparktrain.tune

    SparkSession.builder.master("local[4]").config("spark.ui.enabled", "false").getOrCreate()
    storage = optuna.storages.RDBStorage(storage_url, heartbeat_interval=1, grace_period=3,
                                         heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    study = optuna.create_study(storage=storage, study_name="killed", load_if_exists=True)
    print("driving", flush=True)
    sparktrain.tune.optimize(study, functools.partial(blocked, outdir), n_trials=n_trials, concurrent_trials=2,
                             num_proc=2)


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2], int(sys.argv[3]))


def tf_keras_digits(trial) -> float:
    """A tf_keras fit (``TF_USE_LEGACY_KERAS=1`` in the ranks) pruned by optuna-integration's
    ``TFKerasPruningCallback``; reports how many epochs ran."""
    import tensorflow as tf
    from optuna_integration import TFKerasPruningCallback

    import sparktrain.keras as hvd
    from sparktrain.cli.demo import digits

    hvd.init()
    lr = trial.suggest_float("lr", 1e-6, 1e-1, log=True)
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size(), n_train=600)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(lr * hvd.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    epochs = []
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, validation_data=(x_test, y_test), callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
        tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: epochs.append(epoch)),
        TFKerasPruningCallback(trial, "val_accuracy")])
    trial.set_user_attr(f"line_rank_{hvd.rank()}", type(model).__module__.split(".")[0])
    return history.history["val_accuracy"][-1]


def where(trial) -> float:
    """Keeps the GPUs its rank sees and the Spark task it ran in, reports once, returns its suggestion."""
    import sparktrain

    x = trial.suggest_float("x", 0.0, 1.0)
    trial.set_user_attr(f"gpus_rank_{sparktrain.rank()}", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    trial.report(x, 0)
    return x


def two_values(trial) -> tuple[float, float]:
    """A multi-objective trial: rank 0 returns (x, 1 - x); the other rank returns something else."""
    import sparktrain

    x = trial.suggest_float("x", 0.0, 1.0)
    return (x, 1.0 - x) if sparktrain.rank() == 0 else (-1.0, -1.0)
