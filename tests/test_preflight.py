"""Argument checks, pickling diagnostics and slot arithmetic: pure, no Spark job."""
import threading
import warnings

import cloudpickle
import pytest

import sparktrain
from sparktrain import settings
from sparktrain.driver.launch import capacity, config, preflight
from sparktrain.errors import ClusterConfigError, InsufficientResourcesError, InvalidArgumentError, PicklingFailedError


def noop():
    return None


@pytest.mark.parametrize("num_proc, local, expected", [
    (3, False, (3, False)),
    (-2, False, (2, True)),
    (2, True, (2, True)),
    (None, False, (None, False)),
])
def test_num_proc_accepted(num_proc, local, expected):
    assert preflight.check_num_proc(num_proc, local) == expected


@pytest.mark.parametrize("num_proc, words", [
    (0, "positive integer.*got 0"),
    (True, "must be an int.*got True"),
    ("3", "must be an int.*got '3'"),
    (1.5, "must be an int.*got 1.5"),
])
def test_num_proc_refused_echoes_value(num_proc, words):
    with pytest.raises(InvalidArgumentError, match=words):
        preflight.check_num_proc(num_proc, False)


def test_num_proc_required_for_local_mode():
    with pytest.raises(InvalidArgumentError, match="num_proc is required with local_mode=True"):
        preflight.check_num_proc(None, True)


def _check(**overrides):
    kw = dict(train_fn=noop, args=(), kwargs={}, env=None, stdout=None, stderr=None, verbose=1,
              prefix_output_with_timestamp=False, use_gpu=None, output_ranks=None)
    kw.update(overrides)
    return preflight.check_arguments(**kw)


@pytest.mark.parametrize("overrides, words", [
    ({"train_fn": 42}, "train_fn must be a callable.*42"),
    ({"args": "abc"}, "args must be a tuple or list.*args=\\(value,\\)"),
    ({"args": 5}, "args must be a tuple or list.*int"),
    ({"kwargs": [("a", 1)]}, "kwargs must be a dict"),
    ({"kwargs": {1: "a"}}, "kwargs keys must be identifier strings.*\\[1\\]"),
    ({"env": {"A": 1}}, "env must map str to str; 'A' maps to 1"),
    ({"env": ["A"]}, "env must be a dict"),
    ({"env": {"RANK": "3"}}, "env sets RANK, which sparktrain sets"),
    ({"stdout": "out.txt"}, "stdout must be None or a writable text stream"),
    ({"verbose": 5}, "verbose must be 0, 1 or 2, got 5"),
    ({"verbose": True}, "verbose must be 0, 1 or 2"),
    ({"prefix_output_with_timestamp": "yes"}, "prefix_output_with_timestamp must be True or False"),
    ({"use_gpu": "yes"}, "use_gpu must be True, False or None"),
    ({"output_ranks": "0"}, "output_ranks must be None or 'all'"),
    ({"output_ranks": [-1]}, "output_ranks must be"),
])
def test_bad_arguments_are_named(overrides, words):
    with pytest.raises(InvalidArgumentError, match=words):
        _check(**overrides)


def test_good_arguments_are_normalized():
    args, kwargs, env = _check(args=[1, 2], kwargs=None, env={"A": "b"}, output_ranks=[0])
    assert (args, kwargs, env) == ((1, 2), {}, {"A": "b"})


def test_output_ranks_must_exist():
    assert preflight.normalize_output_ranks(None, 3) is None
    assert preflight.normalize_output_ranks(0, 3) == frozenset({0})
    with pytest.raises(InvalidArgumentError, match=r"output_ranks \[5\] are outside 0..2"):
        preflight.normalize_output_ranks([0, 5], 3)


@pytest.mark.parametrize("value, words", [
    (-1, "positive number of seconds, got -1"),
    (0, "positive number of seconds, got 0"),
    ("soon", "number of seconds, got 'soon'"),
    (float("inf"), "positive number of seconds"),
])
def test_timeouts_refused(value, words):
    with pytest.raises(InvalidArgumentError, match=words):
        settings.parse_seconds("timeout", value, allow_none=True)


def test_settings_resolve_in_order(monkeypatch):
    conf = {"spark.sparktrain.startTimeout": "30"}
    monkeypatch.delenv("SPARKTRAIN_START_TIMEOUT", raising=False)
    assert settings.resolve("start_timeout", None, conf={}) == 600.0
    assert settings.resolve("start_timeout", None, conf=conf) == 30.0
    monkeypatch.setenv("SPARKTRAIN_START_TIMEOUT", "20")
    assert settings.resolve("start_timeout", None, conf=conf) == 20.0
    assert settings.resolve("start_timeout", 10, conf=conf) == 10.0


def test_invalid_arguments_are_value_and_type_errors():
    with pytest.raises(ValueError):
        preflight.check_num_proc(0, False)
    with pytest.raises(TypeError):
        preflight.check_num_proc("3", False)


# -- pickling --------------------------------------------------------------------------------------

def test_pickling_names_a_captured_lock():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(PicklingFailedError, match="'lock' captured by .*train.*_thread.lock"):
        preflight.pickle_payload(train, (), {}, cloudpickle.dumps)


def test_pickling_names_a_bad_argument():
    with pytest.raises(PicklingFailedError, match=r"kwargs\['gen'\].*generator"):
        preflight.pickle_payload(noop, (), {"gen": (i for i in range(3))}, cloudpickle.dumps)


def test_pickling_payload_round_trips():
    data = preflight.pickle_payload(noop, (1,), {"a": 2}, cloudpickle.dumps)
    fn, args, kwargs = cloudpickle.loads(data)
    assert fn() is None and args == (1,) and kwargs == {"a": 2}


# -- cluster conf and slots ---------------------------------------------------------------------------

def test_dynamic_allocation_refused_with_fix():
    with pytest.raises(ClusterConfigError, match="spark.dynamicAllocation.enabled=false"):
        _cluster_check({"spark.dynamicAllocation.enabled": "true"})


def _cluster_check(conf, allow_unencrypted=False, environ=None, **arguments):
    """``check_cluster_conf`` with the values ``run`` would resolve from these."""
    values = config.settings_of(conf, environ or {}, arguments)
    preflight.check_cluster_conf(conf, allow_unencrypted, settings.encrypts(values.encryption, conf),
                                 values.cpu_collectives)


@pytest.mark.parametrize("key", settings.SPARK_ENCRYPTION)
def test_sparks_encryption_turns_sparktrains_on_and_off_is_refused_unless_allowed(key):
    conf, clear = {key: "true"}, {}
    assert settings.encrypts("auto", conf) and not settings.encrypts("auto", clear)
    _cluster_check(conf)  # auto: encrypted, so no refusal
    for off in ({"encryption": "off"}, {"environ": {"SPARKTRAIN_ENCRYPTION": "off"}}):
        with pytest.raises(ClusterConfigError, match=f"{key}=true.*spark.sparktrain.encryption=auto or on.*"
                                                     "spark.sparktrain.allowUnencrypted=true"):
            _cluster_check(conf, **off)
        _cluster_check(conf, True, **off)
    assert config.settings_of({**conf, "spark.sparktrain.encryption": "off"}, {}).encryption == "off"
    assert settings.encrypts(config.settings_of(clear, {}, {"encryption": "on"}).encryption, clear) is True
    with pytest.raises(ClusterConfigError, match="cpu_collectives='tensorflow'.*not encrypt"):
        _cluster_check(conf, environ={"SPARKTRAIN_CPU_COLLECTIVES": "tensorflow"})
    with pytest.raises(InvalidArgumentError, match="encryption must be one of auto, on, off; got 'yes'"):
        settings.resolve("encryption", "yes")


def test_encryption_on_where_no_libcrypto_loads_is_refused_saying_why(monkeypatch):
    from sparktrain.seam import crypto

    monkeypatch.setattr(crypto, "_LIBS", ("libcrypto-absent.so.0",))
    monkeypatch.setattr(crypto, "_lib", None)
    monkeypatch.setattr(crypto, "_why", None)
    assert crypto.unavailable().startswith("no OpenSSL libcrypto could be loaded (tried libcrypto-absent.so.0)")
    with pytest.raises(ClusterConfigError, match="encryption is on .*, but this driver cannot encrypt: no OpenSSL "
                                                 "libcrypto could be loaded .*or set spark.sparktrain.encryption=off"):
        _cluster_check({}, encryption="on")
    _cluster_check({}, encryption="off")


def test_use_gpu_without_gpu_conf():
    with pytest.raises(ClusterConfigError, match="spark.task.resource.gpu.amount=1"):
        capacity.check_gpu_conf({}, True)
    capacity.check_gpu_conf({"spark.task.resource.gpu.amount": "1"}, True)


def test_slot_arithmetic():
    cap = capacity.Capacity(executors=3, cores_per_executor=4, task_cpus=2, gpus_per_executor=1, task_gpus=0.5)
    assert (cap.cpu_slots, cap.gpu_slots) == (6, 6)
    assert cap.slots(use_gpu=False) == 6
    cap = capacity.Capacity(3, 4, 1, gpus_per_executor=1, task_gpus=1)
    assert (cap.cpu_slots, cap.gpu_slots, cap.slots(True), cap.slots(False)) == (12, 3, 3, 12)
    assert capacity.Capacity(3, 4, 1, spark_slots=5).slots(False) == 5
    assert capacity.Capacity(2, 1, 1, gpus_per_executor=1, task_gpus=0.1).gpu_slots == 20


def test_capacity_error_names_required_available_limit_and_fix():
    cap = capacity.Capacity(executors=3, cores_per_executor=1, task_cpus=1, gpus_per_executor=1, task_gpus=1)
    with pytest.raises(InsufficientResourcesError) as e:
        capacity.check_capacity(4, cap, use_gpu=True)
    msg = str(e.value)
    assert "num_proc=4 needs 4 GPU task slots" in msg and "the cluster has 3" in msg
    assert "limited by GPUs" in msg and "lower num_proc to 3" in msg
    with pytest.raises(InsufficientResourcesError, match="limited by CPU task slots.*spark.executor.cores"):
        capacity.check_capacity(5, capacity.Capacity(2, 2, 1), use_gpu=False)
    capacity.check_capacity(3, cap, use_gpu=True)


def test_run_refuses_bad_input_before_spark(monkeypatch):
    # No SparkSession exists in this module: each error must come before one would be started.
    import pyspark.sql

    monkeypatch.setattr(pyspark.sql.SparkSession, "builder", None)
    for kwargs, exc in [({"num_proc": 0}, InvalidArgumentError), ({"num_proc": 2, "args": 1}, InvalidArgumentError),
                        ({"num_proc": 2, "timeout": -1}, InvalidArgumentError),
                        ({"num_proc": 2, "start_timeout": 0}, InvalidArgumentError)]:
        with pytest.raises(exc):
            sparktrain.run(noop, **kwargs)


def test_large_pickle_warns(caplog):
    big = b"x" * (11 * 1024 * 1024)
    with pytest.warns(ResourceWarning, match=r"pickles to 11\.0 MiB"):
        data = preflight.pickle_payload(noop, (big,), {}, cloudpickle.dumps)
    assert len(data) > len(big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight.pickle_payload(noop, (b"small",), {}, cloudpickle.dumps)
