"""sparktrain.run on a real local[3] Spark: ranks, arguments, output, results, failures, cleanup."""
from __future__ import annotations

import io
import json
import os
import re
import threading
import time
import warnings

import pytest

import sparktrain
from helpers import read_ranks, record_rank, wait_for_file, wait_for_ranks, wait_pids_gone
from conftest import module_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


spark = module_spark("local[3]", **{"spark.driver.maxResultSize": "20m"})


def train_record(outdir, lr, epochs=3):
    import sparktrain

    info = record_rank(outdir, lr=lr, epochs=epochs)
    print(f"hello from rank {info['rank']} of {info['size']}")
    return {"rank": sparktrain.rank(), "lr": lr, "epochs": epochs} if sparktrain.is_chief() else "not rank 0"


def test_distinct_ranks_args_kwargs_and_rank0_value(spark, tmp_path):
    out = io.StringIO()
    result = sparktrain.run(train_record, args=(str(tmp_path), 0.1), kwargs={"epochs": 2}, num_proc=3,
                            stdout=out, env={"MY_SETTING": "on"})
    assert result == {"rank": 0, "lr": 0.1, "epochs": 2}
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    assert {r["size"] for r in ranks.values()} == {3}
    assert {(r["lr"], r["epochs"]) for r in ranks.values()} == {(0.1, 2)}
    # local[3] is one host: local ranks 0..2, one cross group.
    assert sorted(r["local_rank"] for r in ranks.values()) == [0, 1, 2]
    assert {(r["local_size"], r["cross_rank"], r["cross_size"]) for r in ranks.values()} == {(3, 0, 1)}
    envs = [ranks[r]["env"] for r in range(3)]
    assert {e["MY_SETTING"] for e in envs} == {"on"}
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"-1"}
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    workers = json.loads(envs[0]["TF_CONFIG"])["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(json.loads(e["TF_CONFIG"])["cluster"]["worker"] == workers for e in envs)
    assert [json.loads(e["TF_CONFIG"])["task"]["index"] for e in envs] == [0, 1, 2]
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"] == workers[0].split(":")[0]
    # Every rank ran in its own fresh process, not in the reused PySpark worker, and is gone now.
    pids = [r["pid"] for r in ranks.values()]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert wait_pids_gone(pids, timeout=5) == []
    lines = out.getvalue().splitlines()
    for r in range(3):
        assert f"[{r}]<stdout>:hello from rank {r} of 3" in lines


def chatty(n_lines):
    import sys

    import sparktrain

    for i in range(n_lines):
        print(f"line {i} of rank {sparktrain.rank()}")
    print(f"warning from rank {sparktrain.rank()}", file=sys.stderr)


def test_output_prefix_timestamp_and_rank_filter(spark):
    out, err = io.StringIO(), io.StringIO()
    sparktrain.run(chatty, args=(3,), num_proc=3, stdout=out, stderr=err, output_ranks=[0, 2],
                   prefix_output_with_timestamp=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} "
    assert all(re.match(stamp + r"\[[02]\]<stdout>:line \d of rank [02]$", line) for line in lines), lines
    # Each rank's lines arrive in order.
    assert [line.split(":")[-1] for line in lines if "[2]<stdout>" in line] == [
        "line 0 of rank 2", "line 1 of rank 2", "line 2 of rank 2"]
    assert sorted(re.sub(stamp, "", line) for line in err.getvalue().splitlines()) == [
        "[0]<stderr>:warning from rank 0", "[2]<stderr>:warning from rank 2"]


def fail_on_rank(bad_rank, outdir, how):
    import os
    import sys

    import sparktrain

    record_rank(outdir)
    if sparktrain.rank() == bad_rank:
        wait_for_ranks(outdir, sparktrain.size())  # fail once every rank is running, so each pid is known
        print("about to fail", flush=True)
        print("details on stderr", file=sys.stderr, flush=True)
        if how == "raise":
            raise ValueError(f"bad shard on rank {bad_rank}")
        os._exit(3)
    # The healthy ranks would train for a long time: they must be stopped, not awaited.
    wait_for_file(os.path.join(outdir, "never"), timeout=120)


def test_exception_on_nonzero_rank_reaches_driver_with_traceback(spark, tmp_path):
    started = time.monotonic()
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(fail_on_rank, args=(1, str(tmp_path), "raise"), num_proc=3, stdout=io.StringIO(),
                       stderr=io.StringIO())
    elapsed = time.monotonic() - started
    err = e.value
    assert err.root_cause.rank == 1
    assert list(err.failures) == [1]  # the ranks sparktrain stopped are not failures
    root = err.root_cause
    assert root.exc_type == "ValueError" and root.message == "bad shard on rank 1"
    assert "in fail_on_rank" in root.traceback and "raise ValueError" in root.traceback
    assert root.output_tail[-2:] == ("about to fail", "[stderr] details on stderr")
    assert root.host and root.local_rank == 1
    text = str(err)
    assert text.startswith("1 rank failed; root cause: rank 1 (local rank 1 on ")
    assert "Remote traceback (rank 1):" in text
    pids = [r["pid"] for r in read_ranks(str(tmp_path)).values()]
    assert len(pids) == 3 and wait_pids_gone(pids, timeout=10) == []
    assert elapsed < 60, f"the healthy ranks were not stopped promptly ({elapsed:.1f} s)"


def test_hard_exit_reports_exit_code(spark, tmp_path):
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(fail_on_rank, args=(2, str(tmp_path), "exit"), num_proc=3, stdout=io.StringIO(),
                       stderr=io.StringIO())
    root = e.value.root_cause
    assert (root.rank, root.exitcode, root.exc_type) == (2, 3, "")
    assert "rank 2 (local rank 2 on" in str(e.value) and "exited with code 3" in str(e.value)
    pids = [r["pid"] for r in read_ranks(str(tmp_path)).values()]
    assert wait_pids_gone(pids, timeout=10) == []


def exit_zero():
    import sys

    print("leaving early", flush=True)
    sys.exit(0)


def test_sys_exit_zero_is_a_success_that_returns_none(spark):
    out = io.StringIO()
    assert sparktrain.run(exit_zero, num_proc=3, stdout=out, stderr=io.StringIO()) is None
    assert out.getvalue().count("leaving early") == 3


def big_result(n_bytes):
    import sparktrain

    return os.urandom(n_bytes) if sparktrain.rank() == 0 else None


def test_large_result_comes_back_in_chunks(spark):
    data = sparktrain.run(big_result, args=(9 * 2**20,), num_proc=2, verbose=0)
    assert isinstance(data, bytes) and len(data) == 9 * 2**20  # three 4 MiB chunks


def patterned_result(n_bytes):
    return (b"sparktrain" * (n_bytes // 10 + 1))[:n_bytes]


@pytest.mark.parametrize("where", ["default", "configured"])
def test_result_over_max_result_size_spills_to_storage_and_comes_back(spark, tmp_path, monkeypatch, caplog, where):
    import tempfile

    caplog.set_level("INFO", logger="sparktrain")
    spill_dir = os.path.join(tempfile.gettempdir(), f"sparktrain-spill-{os.geteuid()}") if where == "default" else str(tmp_path)
    if where == "configured":
        monkeypatch.setenv("SPARKTRAIN_SPILL_URL", f"file://{tmp_path}")
    data = sparktrain.run(patterned_result, args=(25 * 2**20,), num_proc=2)
    assert data == patterned_result(25 * 2**20)
    spilled = re.search(rf"reading it from file://{re.escape(spill_dir)}/(sparktrain-[^\s/]+)", caplog.text)
    assert spilled, caplog.text
    assert not os.path.exists(os.path.join(spill_dir, spilled.group(1)))  # read back, then deleted


def test_result_over_max_result_size_is_refused_with_fix_when_spilling_is_off(spark, monkeypatch):
    monkeypatch.setenv("SPARKTRAIN_SPILL_URL", "none")
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(big_result, args=(25 * 2**20,), num_proc=2, verbose=0)
    root = e.value.root_cause
    assert root.rank == 0 and "ResultTooLargeError" in root.exc_type
    assert "spark.driver.maxResultSize (20 MiB)" in root.message
    assert "checkpoint_url=" in root.message and "spark.sparktrain.spillUrl" in root.message


def unpicklable_result():
    import threading

    return threading.Lock()


def test_unpicklable_return_value_is_named(spark):
    with pytest.raises(sparktrain.RankFailedError, match=r"rank 0's return value \(lock\) cannot be pickled"):
        sparktrain.run(unpicklable_result, num_proc=2, verbose=0)


def quick(i):
    import sparktrain

    return (i, sparktrain.rank(), os.getpid())


def test_start_timeout_names_ranks_that_never_started(spark, tmp_path):
    # Occupy one of the three task slots, so the barrier stage cannot be scheduled.
    sc = spark.sparkContext
    blocker_dir = str(tmp_path)

    def hold(_):
        from helpers import wait_for_file

        open(os.path.join(blocker_dir, "holding"), "w").close()
        try:
            wait_for_file(os.path.join(blocker_dir, "release"), timeout=120)
        except TimeoutError:
            pass
        return [1]

    def blocker():
        sc.setJobGroup("test-blocker", "holds a slot", interruptOnCancel=True)
        try:
            sc.parallelize([0], 1).mapPartitions(hold).collect()
        except Exception:  # noqa: BLE001 - released on purpose
            pass

    t = threading.Thread(target=blocker)
    t.start()
    try:
        wait_for_file(os.path.join(blocker_dir, "holding"), timeout=60)
        with pytest.raises(sparktrain.StartTimeoutError, match=r"rank\(s\) \[0, 1, 2\] to start.*start_timeout"):
            sparktrain.run(quick, args=(0,), num_proc=3, start_timeout=3, verbose=0)
    finally:
        open(os.path.join(blocker_dir, "release"), "w").close()
        t.join(60)
    # The cancelled barrier stage must not block the next run.
    assert sparktrain.run(quick, args=(1,), num_proc=3, verbose=0)[0] == 1


def test_barrier_rendezvous_path(spark, tmp_path, monkeypatch):
    """The path for executors that cannot reach the driver: one Spark allGather, errors via Spark."""
    monkeypatch.setenv("SPARKTRAIN_RENDEZVOUS", "barrier")
    result = sparktrain.run(train_record, args=(str(tmp_path), 0.5), num_proc=3, verbose=0)
    assert result["lr"] == 0.5
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1, 2]
    assert len({r["env"]["TF_CONFIG"] for r in ranks.values()}) == 3  # same cluster, different index
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(fail_on_rank, args=(2, str(tmp_path), "raise"), num_proc=3, verbose=0)
    assert e.value.root_cause.rank == 2 and e.value.root_cause.exc_type == "ValueError"


def test_captured_spark_session_is_refused_on_the_driver(spark):
    def train():
        return spark.range(3).count()

    with pytest.raises(sparktrain.PicklingFailedError, match="'spark' captured by .*cannot travel to executors"):
        sparktrain.run(train, num_proc=2)


def test_each_run_has_its_own_job_group(spark, caplog):
    caplog.set_level("INFO", logger="sparktrain")
    sparktrain.run(quick, args=(1,), num_proc=3)
    sparktrain.run(quick, args=(2,), num_proc=3)
    run_ids = re.findall(r"launching 3 rank\(s\) of quick, run (\w+)", caplog.text)
    assert len(run_ids) == 2 and run_ids[0] != run_ids[1]
    tracker = spark.sparkContext.statusTracker()
    for run_id in run_ids:
        assert len(tracker.getJobIdsForGroup(f"sparktrain-{run_id}")) == 1


def checkpoint_producer(n_bytes, as_file, scratch):
    import os

    import sparktrain

    data = bytes(range(256)) * (n_bytes // 256)
    if not sparktrain.is_chief():
        return None
    if not as_file:
        return data
    path = os.path.join(scratch, "model.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("backend", ["file", "abfs", "s3"])
def test_checkpoint_url_sends_rank0_value_straight_to_storage(spark, tmp_path, backend, request):
    """30 MiB from rank 0 through a session whose spark.driver.maxResultSize is 20m."""
    import uuid

    from sparktrain import storage

    options = None
    if backend == "file":
        url = f"file://{tmp_path}/ckpt/model.bin"
    else:
        options = request.getfixturevalue("azurite").options() if backend == "abfs" else \
            request.getfixturevalue("moto_s3")
        fs, _ = storage.filesystem(f"{backend}://x", options)
        bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        url = f"{backend}://{bucket}/run/model.bin"
    n = 30 * 2**20
    for as_file in (False, True):
        got = sparktrain.run(checkpoint_producer, args=(n, as_file, str(tmp_path)), num_proc=3, verbose=0, checkpoint_url=url,
                             storage_options=options)
        assert got == url
        assert storage.get_bytes(url, options) == bytes(range(256)) * (n // 256)


def test_checkpoint_url_is_checked_before_launch(spark):
    from sparktrain import storage

    with pytest.raises(storage.UnknownSchemeError, match="unknown URL scheme 'nosuch'"):
        sparktrain.run(quick, args=(0,), num_proc=3, checkpoint_url="nosuch://x/y")
    with pytest.raises(sparktrain.RankFailedError, match="must return bytes or the path"):
        sparktrain.run(quick, args=(0,), num_proc=3, verbose=0, checkpoint_url="memory://x/y")


def import_missing_on_task_1(batches):
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    if BarrierTaskContext.get().partitionId() == 1:
        import sparktrain_no_such_module  # noqa: F401
    yield pa.RecordBatch.from_arrays([pa.array([0], pa.int32())], names=["x"])


def test_a_spark_failure_reads_as_the_rank_and_its_python_exception_first(spark):
    from sparktrain.driver.show import spark_errors

    with pytest.raises(Exception) as e:  # what pyspark raises for a failed job
        spark.range(0, 2, 1, 2).mapInArrow(import_missing_on_task_1, "x int", barrier=True).collect()
    failure = spark_errors.read_spark_failure(e.value)
    assert (failure.partition, failure.cause) == (1, "ModuleNotFoundError: No module named 'sparktrain_no_such_module'")
    assert failure.message("run 1234 of train").startswith("the task of partition 1: ModuleNotFoundError")
    message = failure.message("run 1234 of train", rank=1)
    first, second = message.splitlines()[:2]
    assert first == "rank 1: ModuleNotFoundError: No module named 'sparktrain_no_such_module'", message
    assert second.startswith("run 1234 of train failed in Spark: ") and re.search(r"ResultTask\(\d+, 1\)", second), message
    assert not message.rstrip().endswith((":", "Traceback (most recent call last)")), message


def pid_and_env(name):
    import os

    return os.getpid(), os.environ.get(name)


def test_the_retired_warm_rank_process_setting_warns_once_and_changes_nothing(spark, monkeypatch):
    from sparktrain import settings

    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setenv("SPARKTRAIN_WARM_RANK_PROCESS", "true")
    with pytest.warns(FutureWarning, match="SPARKTRAIN_WARM_RANK_PROCESS no longer does anything"):
        first, _ = sparktrain.run(pid_and_env, args=("X",), num_proc=3, verbose=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sparktrain: .* no longer does anything")  # once per process, not per run
        pid, value = sparktrain.run(pid_and_env, args=("MY_SETTING",), num_proc=3, verbose=0,
                                    env={"MY_SETTING": "on"})
    # Every rank process starts with its run, and takes the run's env, even what an interpreter
    # reads as it starts.
    assert pid != first and value == "on"
    assert wait_pids_gone([first, pid], timeout=10) == []


def test_a_run_warns_of_nothing_the_user_did_not_cause(spark):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the suite's own filters hide pyspark's pandas warning
        sparktrain.run(pid_and_env, args=("X",), num_proc=3, verbose=0)
    assert [f"{w.category.__name__}: {w.message}" for w in seen] == []


CONSOLE_SCRIPT = """
import sys, sparktrain
from pyspark.sql import SparkSession

spark = (SparkSession.builder.master("local[2]").config("spark.ui.showConsoleProgress", "true")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")


def slow(_):
    import time
    time.sleep(2.5)
    return 1


spark.sparkContext.parallelize(range(2), 2).map(slow).collect()
print("PLAIN JOB DONE", flush=True)


def train():
    import sys
    import time
    import sparktrain
    for i in range(6):
        print(f"step {i}", file=sys.stderr, flush=True)
        # A bar of its own, redrawn with a carriage return and erased with backspaces, as Keras draws.
        sys.stdout.write("\\b" * 20 + f"\\r  {i + 1}/6 [{'=' * (i + 1):<6}]")
        sys.stdout.flush()
        time.sleep(0.5)  # a slow loop: the stage runs for 3 s, long enough for Spark to draw its bar
    print(" done", flush=True)
    return sparktrain.rank()


print("RESULT", sparktrain.run(train, num_proc=2, verbose=0), flush=True)
spark.stop()
"""


@pytest.mark.timeout(240)
def test_sparks_console_progress_bar_stays_off_the_ranks_lines_in_a_terminal(tmp_path):
    """In a terminal, a session with Spark's console progress bar draws ``[Stage N:>`` for a plain job
    (the control), and nothing of it while a sparktrain stage runs."""
    import pty
    import select
    import subprocess
    import sys

    script = tmp_path / "console.py"
    script.write_text(CONSOLE_SCRIPT)
    primary, secondary = pty.openpty()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=secondary,
                            stderr=secondary, env=env, cwd=tmp_path, start_new_session=True)
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + 200
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # the terminal closed: every process holding it has exited
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(primary)
    text = b"".join(chunks).decode(errors="replace")
    plain, _, ours = text.partition("PLAIN JOB DONE")
    assert "[Stage 0:" in plain, plain[-2000:]  # Spark does draw its bar on this terminal
    assert "RESULT 0" in ours and "[0]<stderr>:step 5" in ours, ours[-2000:]
    assert "[Stage" not in ours, ours[-2000:]
    # The rank's bar: redrawn in place on the terminal's bottom line, never a backspace, and its last
    # state once as a line.
    assert "\b" not in ours and re.search(r"\r\[0\]<stdout>:  [1-5]/6 \[=+ *\]", ours), ours[-2000:]
    assert "[0]<stdout>:  6/6 [======] done" in ours, ours[-2000:]
