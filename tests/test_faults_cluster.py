"""An executor JVM killed mid-run on local-cluster[3,1,1024]: the run fails naming the rank and the
lost executor, and every rank process ends; with max_attempts=2 the gang runs again, on the
executor that replaced the lost one, and succeeds.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import sparktrain
from helpers import fault_time, read_ranks, record_rank, wait_for_file, wait_pids_gone
from conftest import module_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


cluster = module_spark("local-cluster[3,1,1024]", **{"spark.executor.memory": "512m"})


def executor_jvm_of(pid: int) -> psutil.Process:
    """The executor JVM that (through PySpark's daemon and worker) runs the process ``pid``."""
    for parent in psutil.Process(pid).parents():
        if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
            return parent
    raise AssertionError(f"no executor JVM above process {pid}")


def rank_until_released(outdir):
    import sparktrain

    attempt = sparktrain.attempt()
    record_rank(outdir, tag=f"-attempt{attempt}", attempt=attempt)
    if attempt == 1:
        wait_for_file(os.path.join(outdir, "never"), timeout=250)
    return f"attempt {attempt} done"


def _kill_rank_1_executor_when_started(outdir: str, killed: dict) -> threading.Thread:
    def kill():
        for r in range(3):
            wait_for_file(os.path.join(outdir, f"rank-{r}-attempt1.json"), timeout=120)
        rank_1 = read_ranks(outdir, "-attempt1")[1]
        jvm = executor_jvm_of(rank_1["ppid"])
        killed.update(pid=jvm.pid, at=time.time())
        jvm.send_signal(signal.SIGKILL)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def test_a_killed_executor_fails_the_run_naming_the_rank(cluster, tmp_path):
    outdir = str(tmp_path)
    killed: dict = {}
    t = _kill_rank_1_executor_when_started(outdir, killed)
    try:
        with pytest.raises(sparktrain.RankFailedError) as e:
            sparktrain.run(rank_until_released, args=(outdir,), num_proc=3, verbose=0)
    finally:
        t.join(120)
    failed_at = time.time()
    root = e.value.root_cause
    assert root.rank == 1, e.value
    assert "executor" in root.message.lower() and "lost" in root.message.lower(), root.message
    assert not psutil.pid_exists(killed["pid"]) or psutil.Process(killed["pid"]).status() == psutil.STATUS_ZOMBIE
    pids = [r["pid"] for r in read_ranks(outdir, "-attempt1").values()]
    assert len(pids) == 3 and wait_pids_gone(pids, timeout=10) == []
    fault_time("executor JVM SIGKILLed: run fails", 30, failed_at - killed["at"])


def test_with_retries_the_gang_runs_again_on_the_replacement_executor(cluster, tmp_path, caplog):
    caplog.set_level("INFO", logger="sparktrain")
    outdir = str(tmp_path)
    killed: dict = {}
    t = _kill_rank_1_executor_when_started(outdir, killed)
    try:
        result = sparktrain.run(rank_until_released, args=(outdir,), num_proc=3, max_attempts=2)
    finally:
        t.join(120)
    assert result == "attempt 2 done"
    assert sorted(read_ranks(outdir, "-attempt2")) == [0, 1, 2]
    assert "attempt 1 of 2 failed" in caplog.text and "succeeded on attempt 2 of 2" in caplog.text
    fault_time("executor JVM SIGKILLed, max_attempts=2: run succeeds", 90, time.time() - killed["at"])
