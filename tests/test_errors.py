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


def test_a_rank_that_blames_a_dead_peer_is_not_the_root_cause_when_the_peer_failed_too():
    """Rank 0 heard first that rank 1 died under the collective; rank 1's own exit is the cause."""
    blamer = _failure(0, 10.0, exc_type="sparktrain.engine.CollectiveError",
                      message="allreduce: rank 1 (pid 4242, on this host) died during the collective")
    dead = _failure(1, 10.5, exitcode=17)
    err = sparktrain.RankFailedError([blamer, dead])
    assert err.root_cause.rank == 1 and list(err.failures) == [1, 0]
    assert str(err).startswith("2 ranks failed; root cause: rank 1 ")
    # Across hosts the ring's words name the peer too; a peer that did not fail leaves the order alone.
    ring = _failure(0, 10.0, exc_type="sparktrain.engine.CollectiveError",
                    message="allreduce: rank 2 closed its connection (reset): it died or failed")
    assert sparktrain.RankFailedError([ring, _failure(2, 11.0, exitcode=-9)]).root_cause.rank == 2
    assert sparktrain.RankFailedError([ring, _failure(1, 11.0, exitcode=-9)]).root_cause.rank == 0
    # A rank's own error that merely mentions a rank keeps the time order.
    own = _failure(0, 10.0, exc_type="ValueError", message="bad shard")
    assert sparktrain.RankFailedError([own, dead]).root_cause.rank == 0
