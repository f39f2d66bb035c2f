"""Pure pieces around the native engine: settings, the thread defaults, the topology, the key,
and the fallback to TensorFlow's ring when the library is missing. No Spark, no TensorFlow."""
from __future__ import annotations

import logging
import os

import pytest

from sparktrain import engine, settings
from sparktrain.settings import rank as rank_settings
from sparktrain.executor.rankenv import build_worker_env
from sparktrain.host import cpus
from sparktrain.seam import worker_env
from sparktrain.errors import InvalidArgumentError
from sparktrain.executor import rankenv
from sparktrain.executor import rendezvous as task

from helpers import handed_env


def test_cpu_collectives_resolves_env_over_conf_and_refuses_others():
    conf = {"spark.sparktrain.cpuCollectives": "tensorflow"}
    assert settings.resolve("cpu_collectives", conf=conf, environ={}) == "tensorflow"
    assert settings.resolve("cpu_collectives", conf=conf, environ={"SPARKTRAIN_CPU_COLLECTIVES": "native"}) == "native"
    assert settings.resolve("cpu_collectives", environ={}) == "native"
    with pytest.raises(InvalidArgumentError, match="native, tensorflow; got 'gloo'"):
        settings.resolve("cpu_collectives", "gloo")


def test_the_spark_conf_reaches_the_rank_through_its_env_unless_env_says_otherwise():
    conf = {"spark.sparktrain.cpuCollectives": "tensorflow", "spark.sparktrain.cpuTransport": "tcp"}
    assert handed_env({}, conf) == {"SPARKTRAIN_CPU_COLLECTIVES": "tensorflow", "SPARKTRAIN_CPU_TRANSPORT": "tcp",
                                 "SPARKTRAIN_ENCRYPTION": "off"}
    assert handed_env({"SPARKTRAIN_CPU_COLLECTIVES": "native"}, conf)["SPARKTRAIN_CPU_COLLECTIVES"] == "native"
    # The driver's own environment reaches the ranks too, as the driver resolved it; the defaults do not.
    handed = handed_env({}, {}, {"SPARKTRAIN_SPIN_WAIT": "0.01s", "SPARKTRAIN_TF_KERNELS": "false"})
    assert handed == {"SPARKTRAIN_SPIN_WAIT": "0.01", "SPARKTRAIN_TF_KERNELS": "0", "SPARKTRAIN_ENCRYPTION": "off"}
    assert rank_settings.parse(handed).spin_wait == 0.01 and rank_settings.parse(handed).tf_kernels is False


@pytest.mark.parametrize("task_cpus, cores, local_size, threads", [
    (4, 16, 2, 4), (1, 16, 4, 1), (None, 2, 3, 1), (None, 8, 2, 4), (None, None, 1, 1),
])
def test_rank_threads(task_cpus, cores, local_size, threads):
    assert cpus.rank_threads(task_cpus, cores, local_size) == threads


def test_thread_defaults_leave_what_is_set_and_keep_two_inter_op_threads():
    assert cpus.thread_defaults(1, {}) == {
        "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
    assert cpus.thread_defaults(4, {"TF_NUM_INTRAOP_THREADS": "8"}) == {
        "OMP_NUM_THREADS": "4", "TF_NUM_INTEROP_THREADS": "4"}
    env = build_worker_env(rank=0, hosts=["h"], ports=[1], master_port=2, gpu_ids="-1", run_id="r",
                                      threads=3)
    assert env["SPARKTRAIN_THREADS"] == "3"
    assert {"SPARKTRAIN_THREADS", "SPARKTRAIN_COLLECTIVE_KEY_FILE"} <= worker_env.RESERVED_VARS


def test_layout_groups_ranks_by_host_or_makes_each_its_own_with_tcp():
    assert engine.layout(["a", "b", "a", "b"]) == ([0, 1, 0, 1], [0, 0, 1, 1])
    assert engine.layout(["a", "a", "a"], force_tcp=True) == ([0, 1, 2], [0, 0, 0])


def test_the_collective_key_is_derived_per_attempt_and_never_the_secret():
    k1 = task.collective_key(b"s" * 32, "run", 1)
    assert k1 == task.collective_key(b"s" * 32, "run", 1) and len(k1) == 32
    assert k1 not in (b"s" * 32, task.collective_key(b"s" * 32, "run", 2), task.collective_key(b"t" * 32, "run", 1))


def test_a_ranks_ports_are_held_outside_the_kernels_ephemeral_range():
    # Between the handover and the child's bind, nothing the kernel hands out (an outgoing
    # connection's local port, another bind to port 0) can take a port from this range.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    held = [task.reserve_port() for _ in range(16)]
    try:
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == 16
        assert all(10000 <= p < ephemeral_low for p in ports), (ports, ephemeral_low)
    finally:
        for s in held:
            s.close()


def test_the_key_file_is_for_the_rank_only(tmp_path):
    path = rankenv._write_key(str(tmp_path), b"k" * 32)
    assert open(path, "rb").read() == b"k" * 32
    assert os.stat(path).st_mode & 0o077 == 0


def test_a_missing_library_falls_back_to_tensorflows_ring_with_one_warning(monkeypatch, caplog):
    import sparktrain.tensorflow as hvd

    from sparktrain.engine import loader

    monkeypatch.setattr(loader, "_lib", None)
    monkeypatch.setattr(loader, "_lib_error", "sparktrain's native collective engine was not built")
    monkeypatch.delenv("SPARKTRAIN_CPU_COLLECTIVES", raising=False)
    with caplog.at_level(logging.WARNING):
        assert hvd._cpu_engine() == "tensorflow"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0].getMessage()
    assert "TensorFlow's ring" in warnings[0].getMessage()
    monkeypatch.setenv("SPARKTRAIN_CPU_COLLECTIVES", "tensorflow")
    caplog.clear()
    assert hvd._cpu_engine() == "tensorflow" and not caplog.records  # asked for: no warning


def test_the_library_is_found_and_speaks_this_abi():
    if engine.unavailable_reason() is not None:
        pytest.skip(engine.unavailable_reason())
    assert engine.library().stc_abi_version() == engine._ABI_VERSION == 7


def test_the_progress_record_follows_each_collective_and_is_left_inactive_by_a_refused_one(tmp_path):
    """The record a rank's task reads for stall reports (stc_progress): what began last, and that
    nothing runs once a call returned, whichever way it ended."""
    import numpy as np

    from sparktrain.engine import progress

    if engine.unavailable_reason() is not None:
        pytest.skip(engine.unavailable_reason())
    path = str(tmp_path / "progress")
    comm = engine.Communicator(0, 1, ["127.0.0.1"], [0], b"k" * 32, f"progress-{os.getpid()}", timeout=5,
                               progress=path)
    try:
        assert progress.read(path)["n"] == 0 and not progress.read(path)["active"]
        comm.allreduce(np.ones((3, 4), np.float32), op="max")
        at = progress.read(path)
        assert (at["n"], at["active"], at["what"], at["dtype"], at["shape"], at["op"]) == \
            (1, False, "allreduce", "float32", [3, 4], "max")
        assert progress.text(at) == "allreduce #1 (float32[3,4], max)"
        comm.broadcast(np.arange(5, dtype=np.int64), root=0)
        assert progress.text(progress.read(path)) == "broadcast #2 (int64[5], root 0)"
        with pytest.raises(engine.CollectiveError):
            comm.reducescatter(np.float32(1.0))  # refused by the engine after it began: a scalar has no rows
        at = progress.read(path)
        assert at["n"] == 3 and not at["active"], at
    finally:
        comm.close()
    assert progress.read(str(tmp_path / "none")) is None  # no engine, no record


def test_spin_wait_is_auto_or_seconds_and_a_bad_value_fails_on_the_driver_naming_it():
    assert settings.resolve("spin_wait", environ={}) == "auto"
    assert settings.resolve("spin_wait", environ={"SPARKTRAIN_SPIN_WAIT": "0"}) == 0.0
    assert settings.resolve("spin_wait", environ={"SPARKTRAIN_SPIN_WAIT": "0.005"}) == 0.005
    assert handed_env({}, {"spark.sparktrain.spinWait": "0.001"})["SPARKTRAIN_SPIN_WAIT"] == "0.001"
    for bad in ("-1", "2", "fast", "nan"):
        with pytest.raises(InvalidArgumentError, match=f"SPARKTRAIN_SPIN_WAIT must be 'auto' or a number "
                                                       f"of seconds from 0 to 1.*got '{bad}'"):
            settings.resolve("spin_wait", environ={"SPARKTRAIN_SPIN_WAIT": bad})
    # run() reads the ranks' settings on the driver, before it launches anything.
    import sparktrain

    with pytest.raises(InvalidArgumentError, match="SPARKTRAIN_SPIN_WAIT.*got 'fast'"):
        sparktrain.run(print, num_proc=-2, env={"SPARKTRAIN_SPIN_WAIT": "fast"}, verbose=0)
