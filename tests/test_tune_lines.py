"""sparktrain.tune with Optuna's Keras pruning callback on tf_keras (Keras 2): the users' tier.
(Keras 3's KerasPruningCallback runs in notebooks/07-tune.ipynb, in the same tier.)"""
from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("optuna_integration")
pytest.importorskip("tf_keras")

import sparktrain.tune  # noqa: E402

import tune_objectives as objectives  # noqa: E402
from conftest import module_spark  # noqa: E402

pytestmark = [pytest.mark.keras2, pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[2]")


def test_tf_keras_pruning_callback_prunes_the_gang_on_every_rank(spark):
    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1))
    study.enqueue_trial({"lr": 3e-3})
    study.enqueue_trial({"lr": 1e-6})  # learns nothing in 4 epochs: below the median from epoch 1
    sparktrain.tune.optimize(study, objectives.tf_keras_digits, n_trials=2, concurrent_trials=1, num_proc=2,
                             env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"})
    good, poor = study.trials
    assert good.state.name == "COMPLETE" and good.value > 0.8, good
    assert sorted(good.intermediate_values) == [0, 1, 2, 3]
    # The ranks' model was tf_keras's, and both ranks ran the whole fit.
    assert good.user_attrs == {"line_rank_0": "tf_keras", "line_rank_1": "tf_keras"}
    assert poor.state.name == "PRUNED" and sorted(poor.intermediate_values) == [0, 1], poor
