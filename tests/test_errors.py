"""Errors survive pickling and put the root cause first."""
import pickle

import sparktrain
from sparktrain.errors import RankFailure


def _failure(rank, t, **kw):
    return RankFailure(rank=rank, host="h", local_rank=rank, time=t, **kw)


def test_rank_failed_error_root_cause_first_and_pickles():
    later = _failure(2, 20.0, exitcode=-9)
    first = _failure(1, 10.0, exc_type="ValueError", message="bad shard", traceback="Traceback...\nValueError: bad shard",
                     output_tail=("epoch 1", "epoch 2"))
    err = sparktrain.RankFailedError({2: later, 1: first})
    assert list(err.failures) == [1, 2]
    assert err.root_cause.rank == 1
    text = str(err)
    assert text.startswith("2 ranks failed; root cause: rank 1 (local rank 1 on h): ValueError: bad shard")
    assert "killed by SIGKILL" in text and "epoch 2" in text
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is sparktrain.RankFailedError and str(again) == text
    assert again.failures[1].output_tail == ("epoch 1", "epoch 2")


def test_simple_errors_pickle():
    for cls in (sparktrain.InvalidArgumentError, sparktrain.StartTimeoutError, sparktrain.InsufficientResourcesError):
        err = pickle.loads(pickle.dumps(cls("num_proc must be positive, got 0")))
        assert type(err) is cls and "got 0" in str(err)


def test_every_exception_sparktrain_defines_is_a_sparktrainerror():
    import importlib
    import inspect
    import pkgutil

    import sparktrain
    from sparktrain.errors import SparkTrainError

    outside = []
    for info in pkgutil.walk_packages(sparktrain.__path__, "sparktrain."):
        if info.name.endswith(("__main__", "._collective")):  # the engine's library is loaded by ctypes
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name
                    and not issubclass(obj, SparkTrainError)):
                outside.append(f"{info.name}.{name}")
    assert outside == []
