"""Bad input, table-driven, against a real local[2] Spark: each is refused on the driver with an
error naming the bad value and the fix, before any Spark job starts. The few that can only be
seen in a task (a return value that cannot be pickled) fail from rank 0 with a clear message.
"""
from __future__ import annotations

import threading

import pytest

import sparktrain
from sparktrain import storage
from conftest import module_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


spark = module_spark("local[2]")


def ok():
    return 1


_lock = threading.Lock()


def uses_lock():
    with _lock:
        return 1


def _gen():
    yield 1


_generator = _gen()


def uses_generator():
    return next(_generator)


def capturing(context):
    return lambda: context.defaultParallelism


class NotAStream:
    pass


#: (id, run's keyword arguments, error type, words the message must contain)
CASES = [
    ("num_proc 0", dict(num_proc=0), sparktrain.InvalidArgumentError, ["num_proc", "got 0"]),
    ("num_proc -0.0", dict(num_proc=-0.0), sparktrain.InvalidArgumentError, ["num_proc", "-0.0"]),
    ("num_proc 1.5", dict(num_proc=1.5), sparktrain.InvalidArgumentError, ["num_proc", "1.5"]),
    ("num_proc '3'", dict(num_proc="3"), sparktrain.InvalidArgumentError, ["num_proc", "'3'"]),
    ("num_proc True", dict(num_proc=True), sparktrain.InvalidArgumentError, ["num_proc", "True"]),
    ("not callable", dict(train_fn=42), sparktrain.InvalidArgumentError, ["train_fn", "callable", "42"]),
    ("captured lock", dict(train_fn=uses_lock), sparktrain.PicklingFailedError, ["_lock", "lock"]),
    ("captured generator", dict(train_fn=uses_generator), sparktrain.PicklingFailedError, ["_generator", "generator"]),
    ("captured SparkContext", dict(train_fn=capturing), sparktrain.PicklingFailedError,
     ["context", "SparkContext", "executors"]),
    ("args a string", dict(args="abc"), sparktrain.InvalidArgumentError, ["args", "tuple", "'abc'"]),
    ("args a dict", dict(args={"a": 1}), sparktrain.InvalidArgumentError, ["args", "tuple"]),
    ("kwargs int key", dict(kwargs={1: "x"}), sparktrain.InvalidArgumentError, ["kwargs", "1"]),
    ("kwargs not a mapping", dict(kwargs=[("a", 1)]), sparktrain.InvalidArgumentError, ["kwargs"]),
    ("env int value", dict(env={"A": 1}), sparktrain.InvalidArgumentError, ["env", "'A'", "1"]),
    ("env overrides contract", dict(env={"SPARKTRAIN_RANK": "3"}), sparktrain.InvalidArgumentError,
     ["SPARKTRAIN_RANK"]),
    ("timeout negative", dict(timeout=-1), sparktrain.InvalidArgumentError, ["timeout", "-1"]),
    ("start_timeout zero", dict(start_timeout=0), sparktrain.InvalidArgumentError, ["start_timeout", "0"]),
    ("timeout a word", dict(timeout="soon"), sparktrain.InvalidArgumentError, ["timeout", "'soon'"]),
    ("unknown storage scheme", dict(checkpoint_url="nosuch://bucket/model"), storage.UnknownSchemeError,
     ["nosuch", "abfs://", "s3://"]),
    ("output_ranks outside", dict(output_ranks=[5]), sparktrain.InvalidArgumentError, ["output_ranks", "5"]),
    ("verbose 7", dict(verbose=7), sparktrain.InvalidArgumentError, ["verbose", "7"]),
    ("stdout not a stream", dict(stdout=NotAStream()), sparktrain.InvalidArgumentError, ["stdout", "writable"]),
    ("max_attempts 0", dict(max_attempts=0), sparktrain.InvalidArgumentError, ["max_attempts", "0"]),
    ("use_gpu without GPU conf", dict(use_gpu=True), sparktrain.ClusterConfigError,
     ["spark.task.resource.gpu.amount"]),
    ("nics not a name", dict(nics="eth 1"), sparktrain.InvalidArgumentError, ["nics", "'eth 1'", "eth1"]),
    ("nics not on the driver", dict(nics="198.51.100.0/24,nosuch0"), sparktrain.InvalidArgumentError,
     ["nics=198.51.100.0/24,nosuch0", "the driver", "lo 127.0.0.1", "spark.sparktrain.nics"]),
    ("more ranks than slots", dict(num_proc=5), sparktrain.InsufficientResourcesError, ["5", "2"]),
]


def _jobs_started(spark) -> int:
    return int(spark.sparkContext._jsc.sc().dagScheduler().nextJobId())


@pytest.mark.parametrize("case, kwargs, error, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_spark_job(spark, case, kwargs, error, words):
    call = {"train_fn": ok, "num_proc": 2, "verbose": 0, **kwargs}
    if call["train_fn"] is capturing:
        call["train_fn"] = capturing(spark.sparkContext)
    before = _jobs_started(spark)
    with pytest.raises(error) as e:
        sparktrain.run(call.pop("train_fn"), **call)
    message = str(e.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert _jobs_started(spark) == before, "a Spark job started before the bad input was refused"


def test_the_table_has_at_least_twenty_cases():
    assert len(CASES) >= 20


#: A bad value of every setting the ranks read (``settings.READ_IN_RANK``), and words of its error.
RANK_SETTINGS_BAD = {
    "collective_timeout": ("abc", "must be a positive number of seconds, got 'abc'"),
    "cpu_collectives": ("gloo", "must be one of native, tensorflow; got 'gloo'"),
    "cpu_transport": ("rdma", "must be one of auto, tcp; got 'rdma'"),
    "spin_wait": ("fast", "must be 'auto' or a number of seconds from 0 to 1"),
    "tf_kernels": ("maybe", "must be true or false, got 'maybe'"),
    "pin_cores": ("always", "must be one of auto, on, off; got 'always'"),
    "gc_threshold": ("700,10", "must be three whole numbers"),
    "encryption": ("yes", "must be one of auto, on, off; got 'yes'"),
    "elastic_url": ("  ", "must be an fsspec URL"),
    "legacy_keras": ("yes", "TensorFlow reads only 1, true, True as tf_keras"),
    "data_cache_limit": ("lots", "must be 'auto' or a size in bytes such as 20g"),
    "bucket_bytes": ("auto", "must be a size in bytes such as 20g"),
    "timeline": ("  ", "must be a file path"),
}


def test_every_rank_read_setting_has_a_bad_value_here():
    from sparktrain import settings

    assert set(RANK_SETTINGS_BAD) == set(settings.READ_IN_RANK)


@pytest.mark.parametrize("where", ["env", "conf"])
@pytest.mark.parametrize("name", sorted(RANK_SETTINGS_BAD))
def test_a_bad_value_of_a_setting_the_ranks_read_is_refused_before_launch(spark, name, where, tmp_path):
    from sparktrain import settings

    s, (bad, words) = settings.SETTINGS[name], RANK_SETTINGS_BAD[name]
    if where == "conf" and s.conf is None:
        pytest.skip(f"{name} has no Spark conf key: only env= gives it")
    key = s.env if where == "env" else s.conf
    conf = spark.sparkContext._conf
    if where == "conf":
        conf.set(key, bad)
    before = _jobs_started(spark)
    try:
        with pytest.raises(sparktrain.InvalidArgumentError) as e:
            sparktrain.run(touch, args=(str(tmp_path / "ran"),), num_proc=2, verbose=0,
                           env={key: bad} if where == "env" else None)
    finally:
        if where == "conf":
            conf._jconf.remove(key)
    assert key in str(e.value) and words in str(e.value), str(e.value)
    assert _jobs_started(spark) == before and not (tmp_path / "ran").exists()


def touch(path):
    open(path, "w").close()


def returns_unpicklable():
    import threading

    import sparktrain

    return threading.Lock() if sparktrain.rank() == 0 else None


def test_a_return_value_that_cannot_be_pickled_fails_from_rank_0_clearly(spark):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(returns_unpicklable, num_proc=2, verbose=0)
    root = e.value.root_cause
    assert root.rank == 0
    assert "rank 0's return value (lock) cannot be pickled" in root.message
    assert "Return bytes, a path or URL" in root.message


ELASTIC = {"SPARKTRAIN_ELASTIC_URL": "file:///tmp/sparktrain-elastic-never-written"}


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_proc=2), sparktrain.InvalidArgumentError, ["elastic_url", "SPARKTRAIN_ELASTIC_URL", "spark.sparktrain.elasticUrl"]),
    (dict(num_proc=2, env=ELASTIC, max_attempts=3), sparktrain.InvalidArgumentError, ["max_attempts", "reset_limit"]),
    (dict(num_proc=3, min_num_proc=3, env=ELASTIC), sparktrain.InsufficientResourcesError,
     ["min_num_proc=3", "local[2]", "2 task slot(s)"]),
    (dict(num_proc=2, min_num_proc=3, max_num_proc=4, env=ELASTIC), sparktrain.InvalidArgumentError,
     ["min_num_proc <= num_proc <= max_num_proc", "3 <= 2 <= 4"]),
    (dict(num_proc=2, env=ELASTIC, reset_limit=-1), sparktrain.InvalidArgumentError, ["reset_limit", "-1"]),
], ids=["no elastic_url", "max_attempts", "min over the slots", "min over num_proc", "reset_limit"])
def test_run_elastic_refuses_bad_input_before_any_spark_job(spark, kwargs, error, words):
    before = _jobs_started(spark)
    with pytest.raises(error) as e:
        sparktrain.run_elastic(ok, verbose=0, **kwargs)
    assert _jobs_started(spark) == before
    for word in words:
        assert word in str(e.value), str(e.value)


def raises_value_error():
    raise ValueError("a bug in train_fn")


def test_run_elastic_ends_at_once_when_train_fn_itself_raises(spark):
    """An exception of train_fn's own is not a lost rank: no restart, whatever reset_limit allows."""
    before = _jobs_started(spark)
    with pytest.raises(sparktrain.RankFailedError, match="a bug in train_fn"):
        sparktrain.run_elastic(raises_value_error, num_proc=2, env=ELASTIC, verbose=0)
    assert _jobs_started(spark) - before == 1  # one attempt's barrier stage, not a second


def lose_a_rank_once(outdir):
    """Says which run and elastic id it saw; on the first attempt, rank 1 fails as a rank does
    whose peer went away (a lost rank: the run restarts), on the second every rank returns."""
    import os
    import time

    import sparktrain

    class CollectiveError(Exception):
        pass

    attempt, rank = os.environ["SPARKTRAIN_ELASTIC_ATTEMPT"], sparktrain.rank()
    with open(os.path.join(outdir, f".{attempt}-{rank}"), "w") as f:
        f.write(f"{os.environ['SPARKTRAIN_RUN_ID']} {os.environ['SPARKTRAIN_ELASTIC_ID']} {sparktrain.attempt()}")
    os.replace(os.path.join(outdir, f".{attempt}-{rank}"), os.path.join(outdir, f"{attempt}-{rank}"))
    if attempt == "1" and rank == 1:
        for _ in range(600):  # once rank 0 has said what it saw, before the driver stops it
            if os.path.exists(os.path.join(outdir, "1-0")):
                break
            time.sleep(0.05)
        raise CollectiveError("a peer went away")
    return attempt


def test_run_elastic_restarts_on_one_run_id_and_one_pickled_payload(spark, tmp_path, monkeypatch):
    """Every attempt of run_elastic is one more attempt of one run: train_fn is pickled once, and
    the ranks of both attempts see the same run id, which is the elastic id their commits go under."""
    from sparktrain.seam import payload

    pickled = []
    dumps = payload.dumps
    monkeypatch.setattr(payload, "dumps", lambda obj: pickled.append(obj) or dumps(obj))
    before = _jobs_started(spark)
    env = {"SPARKTRAIN_ELASTIC_URL": f"file://{tmp_path}/elastic"}
    assert sparktrain.run_elastic(lose_a_rank_once, args=(str(tmp_path),), num_proc=2, env=env, verbose=0) == "2"
    assert [fn for fn, _, _ in pickled] == [lose_a_rank_once] and _jobs_started(spark) - before == 2
    seen = {name: (tmp_path / name).read_text().split() for name in ("1-0", "1-1", "2-0", "2-1")}
    assert len({run_id for run_id, _, _ in seen.values()}) == 1, seen
    assert all(elastic_id == run_id for run_id, elastic_id, _ in seen.values()), seen
    assert [seen[name][2] for name in sorted(seen)] == ["1", "1", "2", "2"]  # sparktrain.attempt() follows
