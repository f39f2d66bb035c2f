"""Horovod-style scripts, unchanged but for their imports: TF2/Keras scripts on 2 ranks through
`sparktrain run --local`, and a Spark estimator script run as Horovod's examples are, with python."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")
# The Horovod users' tier (-m keras2): their scripts as they wrote them, on Keras 3 and on tf_keras.
pytestmark = pytest.mark.keras2

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_scripts")


def sparktrain_run(script: str, *script_args: str, cwd, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return subprocess.run([sys.executable, "-m", "sparktrain", "run", os.path.join(SCRIPTS, script), "--local",
                           "--num-proc", "2", "--env", "SPARKTRAIN_COLLECTIVE_TIMEOUT=60", "--", *script_args],
                          capture_output=True, text=True, timeout=280, cwd=cwd, env=env)


def rank_lines(stdout: str, rank: int) -> list[str]:
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(300)
def test_keras_digits_script_trains_on_2_ranks(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    proc = sparktrain_run("keras_digits.py", "--epochs", "4", "--fp16-allreduce", "--backward-passes-per-step", "2",
                          "--checkpoint-dir", str(checkpoints), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero = rank_lines(proc.stdout, 0)
    assert len([line for line in zero if re.match(r"^Epoch \d/4$", line)]) == 4, zero
    assert "Epoch 1: finished learning-rate warm-up to 0.004." in zero  # 0.002 x 2 ranks
    # Keras's own progress lines are rank 0's only (verbose=0 elsewhere).
    assert not [line for r in (1,) for line in rank_lines(proc.stdout, r) if line.startswith("Epoch")]
    # Rank 0 alone saved a checkpoint each epoch.
    assert sorted(os.listdir(checkpoints)) == [f"checkpoint-{e}.keras" for e in range(1, 5)]
    results = {}
    for r in range(2):
        found = [re.match(r"^rank (\d) of 2: test accuracy ([\d.]+), test loss ([\d.]+)$", line)
                 for line in rank_lines(proc.stdout, r)]
        found = [m for m in found if m]
        assert len(found) == 1 and int(found[0].group(1)) == r, rank_lines(proc.stdout, r)
        results[r] = (float(found[0].group(2)), found[0].group(3))
    # Equal weights on every rank: the same accuracy and loss, to the last printed digit.
    assert len(set(results.values())) == 1, results
    assert results[0][0] > 0.8, results


@pytest.mark.timeout(300)
def test_synthetic_benchmark_script_prints_images_per_second(tmp_path):
    proc = sparktrain_run("synthetic_benchmark.py", "--num-iters", "3", "--num-batches-per-iter", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero = rank_lines(proc.stdout, 0)
    assert "Number of CPUs: 2" in zero and "Batch size: 8" in zero, zero
    iters = [float(m.group(1)) for m in (re.match(r"^Iter #\d: ([\d.]+) img/sec per CPU$", line) for line in zero) if m]
    assert len(iters) == 3 and all(v > 0 for v in iters), zero
    per = next(re.match(r"^Img/sec per CPU: ([\d.]+) \+-([\d.]+)$", line) for line in zero if line.startswith("Img/sec"))
    total = next(re.match(r"^Total img/sec on 2 CPU\(s\): ([\d.]+) \+-([\d.]+)$", line)
                 for line in zero if line.startswith("Total"))
    assert per and total, zero
    assert float(total.group(1)) == pytest.approx(2 * float(per.group(1)), abs=0.2)
    assert min(iters) - 0.1 <= float(per.group(1)) <= max(iters) + 0.1
    assert not rank_lines(proc.stdout, 1)  # Horovod's log(): rank 0 only


@pytest.mark.timeout(480)
def test_keras_spark_estimator_script_trains_and_scores_a_dataframe(tmp_path):
    """Horovod's keras_spark_mnist.py, on the digits: libsvm's sparse 64-long vectors feed an (8, 8, 1)
    input, OneHotEncoder's sparse labels the softmax; SparkBackend, Store.create and
    inmemory_cache_all as Horovod's."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYSPARK_PYTHON=sys.executable, SPARKTRAIN_COLLECTIVE_TIMEOUT="60")
    env.pop("PYSPARK_GATEWAY_PORT", None)
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "keras_spark_digits.py"), "--num-proc", "2",
                           "--epochs", "2", "--work-dir", str(tmp_path / "store"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=420, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    accuracy = [float(m.group(1)) for m in re.finditer(r"^Test accuracy: ([\d.]+)$", proc.stdout, re.M)]
    assert len(accuracy) == 1 and accuracy[0] > 0.7, proc.stdout[-3000:]
    # The backend's prefix_output_with_timestamp: rank 0's Keras lines carry the time.
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[0\]<stdout>:Epoch 2/2$", proc.stdout, re.M), proc.stdout[-3000:]
    assert proc.stderr.count("inmemory_cache_all=True has no effect here") == 1, proc.stderr[-3000:]
    runs = os.listdir(tmp_path / "store" / "runs")
    assert len(runs) == 1 and os.path.exists(tmp_path / "store" / "runs" / runs[0] / "model.keras"), runs


@pytest.mark.timeout(300)
def test_keras_2_script_trains_on_tf_keras_through_sparktrain_run(tmp_path):
    """A horovodrun-style Keras 2 script (Horovod's tensorflow2_keras_mnist.py in shape) under
    TF_USE_LEGACY_KERAS=1, on 2 ranks started by the command."""
    import numpy as np

    from helpers import digits

    (x, y), (x_test, y_test) = digits()
    np.savez(tmp_path / "digits.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    proc = sparktrain_run("keras2_digits.py", "--data", str(tmp_path / "digits.npz"), "--epochs", "4", "--steps", "40",
                          cwd=tmp_path, env={"TF_USE_LEGACY_KERAS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero, one = rank_lines(proc.stdout, 0), rank_lines(proc.stdout, 1)
    results = {}
    for r, lines in ((0, zero), (1, one)):
        found = [m for m in (re.match(r"^rank (\d) of 2: (\w+) model, test accuracy ([\d.]+), test loss ([\d.]+)$", line)
                             for line in lines) if m]
        assert len(found) == 1 and int(found[0].group(1)) == r, lines
        assert found[0].group(2) == "tf_keras", lines  # tf.keras was tf_keras on the rank
        results[r] = (float(found[0].group(3)), found[0].group(4))
    # Trained, far above chance (0.1), and to the same weights on both ranks (the same digits printed).
    assert results[0][0] > 0.5 and results[0] == results[1], results
    # The warm-up reached 0.001 x 2 ranks at the end of its third epoch, said once (Keras 2's progress
    # bar, verbose=1, may leave it inside a line of its own).
    assert re.findall(r"warm-up to \d+\.\d+", proc.stdout) == ["warm-up to 0.002"], proc.stdout[-3000:]
    assert "Epoch 3: finished learning-rate warm-up to 0.002." in proc.stdout
    assert len(re.findall(r"^\[0\]<stdout>:Epoch \d/4$", proc.stdout, re.M)) == 4, zero
    assert len(one) == 1, one  # verbose=0 on rank 1: its result line alone
    # Rank 0 alone wrote a checkpoint each epoch, in the directory the command ran in.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{e}.h5" for e in range(1, 5)]


def _epoch_logs(stdout: str) -> list[dict[str, float]]:
    """Rank 0's end-of-epoch Keras lines (verbose=2), as {metric: value}, on either Keras."""
    return [{k: float(v) for k, v in re.findall(r"(\w+): ([\d.]+(?:e[+-]?\d+)?)", line)}
            for line in rank_lines(re.sub(r"^\S+ \S+ (?=\[\d\]<)", "", stdout, flags=re.M), 0)
            if "val_exp_rmspe: " in line]


@pytest.mark.timeout(480)  # both lines: the Keras 3 run is the same script with learning_rate=
@pytest.mark.parametrize("keras_line", ["keras", "tf_keras"])
def test_a_sales_estimator_script_trains_scores_and_reloads_on_either_keras(tmp_path, keras_line):
    """Horovod's Rossmann estimator example in shape, on a made-up table of its kind: 15 named inputs
    (embeddings for 11 categorical ones), a custom activation and a custom metric in custom_objects,
    BestModelCheckpoint on val_exp_rmspe, a boolean validation column and a double log-sales label,
    which reaches the metric (tf.exp(y_true) - tf.exp(y_pred)) as the float32 of the model's output.
    On Keras 3 with Adam(learning_rate=...), and on Keras 2 as written for it: TF_USE_LEGACY_KERAS=1,
    tf.keras and Adam(lr=...); the model trains, scores and is scored again after saving and loading,
    with tf_keras where it was built with it; the best validation RMSPE it prints is the kept model's,
    re-scored on the validation rows."""
    if keras_line == "tf_keras":
        pytest.importorskip("tf_keras")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYSPARK_PYTHON=sys.executable, SPARKTRAIN_COLLECTIVE_TIMEOUT="60")
    env.pop("PYSPARK_GATEWAY_PORT", None)
    env.pop("TF_USE_LEGACY_KERAS", None)
    if keras_line == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "keras_spark_sales_estimator.py"), "--num-proc", "2",
                           "--epochs", "3", "--width", "32", "--batch-size", "8", "--val-batch-size", "40",
                           "--learning-rate", "0.003", "--data-dir", str(tmp_path),
                           "--work-dir", str(tmp_path / "store"), "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=420, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert f"Trained with: {keras_line}" in out, proc.stdout[-3000:]
    epochs = _epoch_logs(proc.stdout)
    assert len(epochs) == 3, epochs
    assert all({"loss", "exp_rmspe", "val_loss", "val_exp_rmspe"} <= set(e) for e in epochs), epochs
    assert epochs[-1]["loss"] < epochs[0]["loss"], epochs
    by_epoch = next(line for line in out if line.startswith("Validation RMSPE by epoch: "))
    history = [float(v) for v in by_epoch.split(": ", 1)[1].split(", ")]
    assert len(history) == 3 and f"Lowest validation RMSPE: {min(history):f}" in out
    # The history holds the epochs' metrics averaged over the ranks, as rank 0's Keras lines print them.
    assert history == pytest.approx([e["val_exp_rmspe"] for e in epochs], abs=1e-4)
    # The kept model (the best epoch's) scored again on the validation rows: its RMSPE is the best one the
    # history printed. Not to the digit: the history averages the ranks' per-batch RMSPE (6 batches of 40),
    # each rank with its own BatchNormalization statistics, where this is one pass over all 240 rows with
    # rank 0's. A label fed as (batch,) against the (batch, 1) output broadcast the metric to every pair of
    # rows on Keras 3 (0.524 printed for 0.197 re-scored, issue 58); measured here: 0.474 for 0.497.
    rescored = next(line for line in out if line.startswith("Kept model re-scored, validation RMSPE: "))
    assert min(history) == pytest.approx(float(rescored.rsplit(": ", 1)[1]), rel=0.1), (history, rescored)
    forecast = open(tmp_path / "forecast.csv").read().splitlines()
    assert forecast[0] == "Id,Sales_pred" and len(forecast) == 1 + 24 * 10, forecast[:3]
    assert sorted(int(row.split(",")[0]) for row in forecast[1:]) == list(range(1, 241))
    assert all(0 < float(row.split(",")[1]) < float("inf") for row in forecast[1:]), forecast[:5]
    assert "Loaded model stage scores the same: True" in out and "Loaded pipeline scores the same: True" in out
    assert f"Loaded estimator: optimizer {keras_line}.Adam, model {keras_line}" in out, proc.stdout[-2000:]
    runs = os.listdir(tmp_path / "store" / "runs")
    run = tmp_path / "store" / "runs" / runs[0]
    assert len(runs) == 1 and (run / "model.keras").exists(), runs
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.endswith(".keras")) == [
        f"epoch-{e:04d}.keras" for e in (1, 2, 3)]
