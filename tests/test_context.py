"""The worker-side API reads the env contract; strict when half-set, rank 0 of 1 outside a run."""
import warnings

import pytest

import sparktrain
from sparktrain import context


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("SPARKTRAIN_RANK", "SPARKTRAIN_SIZE", "SPARKTRAIN_LOCAL_RANK", "SPARKTRAIN_LOCAL_SIZE",
                 "SPARKTRAIN_CROSS_RANK", "SPARKTRAIN_CROSS_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(context, "_warned", False)
    return monkeypatch


def test_outside_a_run_is_rank_0_of_1_with_one_warning(clean_env):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (sparktrain.rank(), sparktrain.size(), sparktrain.local_rank(), sparktrain.local_size(),
                sparktrain.cross_rank(), sparktrain.cross_size(), sparktrain.is_chief()) == (0, 1, 0, 1, 0, 1, True)
    assert len([w for w in caught if "not running inside sparktrain.run" in str(w.message)]) == 1


def test_inside_a_run_reads_the_contract(clean_env):
    values = {"SPARKTRAIN_RANK": "2", "SPARKTRAIN_SIZE": "4", "SPARKTRAIN_LOCAL_RANK": "0",
              "SPARKTRAIN_LOCAL_SIZE": "2", "SPARKTRAIN_CROSS_RANK": "1", "SPARKTRAIN_CROSS_SIZE": "2"}
    for k, v in values.items():
        clean_env.setenv(k, v)
    assert (sparktrain.rank(), sparktrain.size(), sparktrain.local_rank(), sparktrain.local_size(),
            sparktrain.cross_rank(), sparktrain.cross_size(), sparktrain.is_chief()) == (2, 4, 0, 2, 1, 2, False)


def test_half_set_env_is_an_error_naming_what_is_missing(clean_env):
    clean_env.setenv("SPARKTRAIN_RANK", "1")
    with pytest.raises(sparktrain.SparkTrainError, match="half-set.*SPARKTRAIN_SIZE"):
        sparktrain.size()
